//! The doorbell's memory: a target's slots and mailboxes as registered
//! memory ([`TargetDoorbell`], its bookkeeping in
//! [`crate::wire::doorbell`]) and a source's mapping of them, read through
//! the seqlock helpers of `kvcr_sys::seqlock`. Doorbell records and
//! mailbox requests are control messages that go by shared memory instead
//! of the socket, so they sit with the network; what they mean is in
//! [`crate::wire`].

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{Body, Message, SegmentAdvert};
use kvcr_ucx::Registration;

use crate::wire::doorbell::DoorbellState;
use crate::wire::mailbox::{self, MailboxView};
use crate::wire::region::slot_offset;
use kvcr_sys::segment::PeerSegment;
use kvcr_sys::seqlock::{publish_shared, read_shared};

/// A source's mailbox in a target's doorbell file, read through its
/// mapping of that file.
pub(crate) type RouteMailbox = mailbox::RouteMailbox<Arc<PeerSegment>>;

impl MailboxView for Arc<PeerSegment> {
    fn sequence(&self, remote: u64) -> Option<u64> {
        PeerSegment::sequence(self, remote)
    }

    fn read_record(&self, remote: u64, out: &mut [u8]) -> bool {
        PeerSegment::read_record(self, remote, out)
    }
}

/// The target's side: the slots (and mailboxes) as registered memory, and
/// their bookkeeping ([`DoorbellState`], whose methods it offers too).
pub(crate) struct TargetDoorbell {
    slots: Registration<'static>,
    state: DoorbellState,
}

impl Deref for TargetDoorbell {
    type Target = DoorbellState;

    fn deref(&self) -> &DoorbellState {
        &self.state
    }
}

impl DerefMut for TargetDoorbell {
    fn deref_mut(&mut self) -> &mut DoorbellState {
        &mut self.state
    }
}

impl TargetDoorbell {
    /// `slots`: [`REGION_BYTES`](crate::wire::region::REGION_BYTES)
    /// registered bytes, zeroed; `rkey` packed for them (every advertised
    /// region has one, and a source on another host unpacks it like the
    /// rest); `segment`: the advert of the shared file they are, when our
    /// pools are shared too.
    pub(crate) fn new(
        slots: Registration<'static>,
        rkey: Vec<u8>,
        segment: Option<SegmentAdvert>,
    ) -> Self {
        let state = DoorbellState::new(slots.as_ptr() as usize as u64, rkey, segment);
        Self { slots, state }
    }

    /// [`DoorbellState::advertise`], and the session's owner record written
    /// into its mailbox before the metadata leaves (a same-host source maps
    /// our pools only once it finds the tag naming itself there).
    pub(crate) fn advertise(&mut self, to: &ControlEndpoint, session: u64, body: &mut Body) {
        self.state.advertise(to, session, body);
        if let Some((offset, tag)) = self.state.owner_record(to) {
            publish_shared(&self.slots, offset, &tag);
        }
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
        self.state
            .request_record(to, (session, index), frame)
            .is_some_and(|(offset, record)| publish_shared(&self.slots, offset, &record))
    }

    /// The `write_done`s the watched slots hold now, each with the
    /// identity of the session its key was sent on (`dialed`: our session
    /// to an endpoint, its id and who answered it), and how many records
    /// naming a watched operation did not verify.
    pub(crate) fn take(
        &mut self,
        dialed: impl Fn(&ControlEndpoint) -> Option<(u64, Incarnation)>,
    ) -> (Vec<(Message, Option<u64>, bool)>, u64) {
        let slots = &self.slots;
        self.state.take_with(
            |op, record| read_shared(slots, slot_offset(op), record),
            dialed,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::doorbell::RouteDoorbell;
    use crate::wire::mailbox::Polled;
    use crate::wire::part::{Part, PartFit};
    use crate::wire::record::{RecordKey, SLOT_BYTES};
    use crate::wire::region::{MAILBOX_FRAME_MAX, MAILBOXES, REGION, REGION_BYTES, SLOTS};
    use crate::wire::region::{mailbox_of, mailbox_offset};
    use kvcr_contracts::protocol::{
        Body, CompletedIndices, DoorbellAdvert, OpHandle, RegionAdvert, RegionId, WriteOutcome,
    };
    use kvcr_runner_core::MAX_ADVERTISED_REGIONS;
    use proptest::prelude::*;

    /// A target's doorbell in a shared file, and a source's mapping of that
    /// file (as a one-copy route maps it), with the target's base address.
    fn shared_doorbell() -> (TargetDoorbell, Arc<PeerSegment>, u64) {
        let context = kvcr_ucx::Context::new().unwrap();
        let file = kvcr_sys::memfd::SharedPool::create(REGION_BYTES as u64, true).unwrap();
        let segment = file.advert(REGION);
        let scope = kvcr_sys::memfd::HostScope::current().unwrap();
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
            device_regions: Vec::new(),
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
        let [(message, digest, checked_in_copy)] = taken.as_slice() else {
            panic!("{taken:?}");
        };
        assert_is_write_done_of_op_5(message, &a);
        assert_eq!(*digest, None, "sealed without a digest");
        assert!(!checked_in_copy);
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
    }
}
