//! The doorbell's bookkeeping, sans-I/O: a target's keys per source
//! session and the operations it awaits ([`DoorbellState`]), what a
//! verified slot record or write message stands for, and a source's
//! doorbell on one route ([`RouteDoorbell`]). The slots' memory is read and
//! written by the driver ([`crate::net::doorbell`]), which hands records in.
//!
//! The doorbell itself: a same-host source's early word that a write's bytes
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

use std::collections::HashMap;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{
    Body, CompletedIndices, DoorbellAdvert, Header, Message, OpHandle, RegionAdvert, RegionId,
    RouteGeneration, SegmentAdvert, WriteOutcome,
};
use kvcr_runner_core::MAX_ADVERTISED_REGIONS;

use super::mailbox::{MailboxView, RouteMailbox};
use super::part::{LandedParts, Part, PartFit, spans_in_range};
use super::record::{RecordKey, SLOT_BYTES, record_op};
use super::region::{REGION, REGION_BYTES, mailbox_of, mailbox_offset, slot_offset};

/// Keys drawn at most for a session before it goes without a mailbox.
const MAILBOX_DRAWS: usize = 16;

/// Most operations a target watches slots for at once; past it, new ones
/// are left to their `write_done` (the set is also pruned every tick).
const MAX_AWAITED: usize = 4096;

/// A session's key as the target holds it.
pub(crate) struct SessionKey {
    /// The control session (we dialed) the key was sent on.
    session: u64,
    key: RecordKey,
    bytes: [u8; 32],
    /// The mailbox the key picks, when no other live session holds it.
    pub(crate) mailbox: Option<usize>,
    /// The source said it maps our file (so it may read the mailbox).
    maps_us: bool,
}

/// The target's side, apart from the slots' memory: its advert, the key
/// per source session, and the operations whose slots it watches.
pub(crate) struct DoorbellState {
    advert: RegionAdvert,
    /// The slots' file, advertised beside the pools' (a same-host source
    /// maps it with them); `None` when the pools are not shared segments
    /// (the slots are then plain registered memory: the region is
    /// advertised for its key's sake, and no source rings it).
    pub(crate) segment: Option<SegmentAdvert>,
    /// The key per source (our current session to it).
    pub(crate) keys: HashMap<ControlEndpoint, SessionKey>,
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

impl DoorbellState {
    /// `base`: the address of [`REGION_BYTES`] registered bytes, zeroed;
    /// `rkey` packed for them (every advertised region has one, and a
    /// source on another host unpacks it like the rest); `segment`: the
    /// advert of the shared file they are, when our pools are shared too.
    pub(crate) fn new(base: u64, rkey: Vec<u8>, segment: Option<SegmentAdvert>) -> Self {
        let advert = RegionAdvert {
            id: REGION,
            label: "kvcr-doorbell".to_owned(),
            base,
            element_size: SLOT_BYTES as u64,
            stride: SLOT_BYTES as u64,
            count: (REGION_BYTES / SLOT_BYTES) as u64,
            rkey,
        };
        Self {
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

    /// The mailbox record to post for `frame` (the encoded `start_write`
    /// just sent to `to` as message `index` of our session `session`) and
    /// the offset of `to`'s mailbox in the region, when `to` maps our file,
    /// the key it holds was sent on that session, and the frame fits.
    pub(crate) fn request_record(
        &self,
        to: &ControlEndpoint,
        (session, index): (u64, u64),
        frame: &[u8],
    ) -> Option<(usize, Vec<u8>)> {
        let key = self.keys.get(to)?;
        let mailbox = key
            .mailbox
            .filter(|_| key.maps_us && key.session == session && self.segment.is_some())?;
        let record = key.key.seal_request(index, frame)?;
        Some((mailbox_offset(mailbox), record))
    }

    /// The owner record of `to`'s key, when it has a mailbox: the offset
    /// of its sequence word in the region and the tag (see
    /// [`RecordKey::owner_tag`]).
    pub(crate) fn owner_record(&self, to: &ControlEndpoint) -> Option<(usize, [u8; 32])> {
        let key = self.keys.get(to)?;
        let mailbox = key.mailbox?;
        Some((super::region::owner_offset(mailbox), key.key.owner_tag(to)))
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

    /// The `write_done`s the watched slots hold now (`read`: copies the
    /// slot of an operation, `false` when it cannot), each with the
    /// identity of the session its key was sent on (`dialed`: our session
    /// to an endpoint, its id and who answered it), and how many records
    /// naming a watched operation did not verify.
    pub(crate) fn take_with(
        &mut self,
        mut read: impl FnMut(OpHandle, &mut [u8; SLOT_BYTES]) -> bool,
        dialed: impl Fn(&ControlEndpoint) -> Option<(u64, Incarnation)>,
    ) -> (Vec<(Message, Option<u64>, bool)>, u64) {
        let mut taken = Vec::new();
        let mut refused = 0;
        for (op, Awaited { source, .. }) in &self.awaited {
            let mut record = [0u8; SLOT_BYTES];
            if !read(*op, &mut record) {
                continue;
            }
            if record_op(&record) != *op {
                continue;
            }
            let Some(key) = self.keys.get(source) else {
                continue;
            };
            let Some((keys, digest, checked)) = key.key.open_digested(*op, &record) else {
                refused += 1;
                continue;
            };
            if let Some(done) = write_done(source, key.session, *op, keys, &dialed) {
                taken.push((*op, (done, digest, checked)));
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
        let (keys, part, digest) = key.key.open_message_digested(op, header)?;
        let done = write_done(source, key.session, op, keys, &dialed)?;
        Some(OpenedMessage {
            op,
            keys,
            part,
            done,
            digest,
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

/// A write message whose header verified (see
/// [`TargetDoorbell::open_message`]).
pub(crate) struct OpenedMessage {
    pub(crate) op: OpHandle,
    pub(crate) keys: u32,
    pub(crate) part: Part,
    /// The whole write's `write_done`.
    pub(crate) done: Message,
    /// The digest of the write's pages its header carries, if any.
    pub(crate) digest: Option<u64>,
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
    pub(crate) fn mailbox<V: MailboxView>(&self, slots: V) -> Option<RouteMailbox<V>> {
        let remote = self.base.checked_add(mailbox_offset(self.mailbox) as u64)?;
        RouteMailbox::new(self.key.clone(), slots, remote)
    }

    /// The record for `op` (`keys` landed, their pages' digest `digest`,
    /// each page `checked_in_copy` or not) and the target address of its
    /// slot.
    pub(crate) fn ring(
        &self,
        op: OpHandle,
        keys: u32,
        digest: Option<u64>,
        checked_in_copy: bool,
    ) -> ([u8; SLOT_BYTES], u64) {
        let record = self.key.seal_digested(op, keys, digest, checked_in_copy);
        (record, self.base + slot_offset(op) as u64)
    }
}
