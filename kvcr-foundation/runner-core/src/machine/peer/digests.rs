//! Page digests in the index: one per record, taken at deposit (the driver
//! hashes a deposit's destination bytes on the copy thread and reports it
//! with the copy), carried in `write_done` by a source, checked by the
//! destination's driver over the landed bytes before the core hears of the
//! completion, and kept with a restored page so it can be served on.
//!
//! The core never hashes: it keeps the digests, says where an operation's
//! bytes landed ([`Core::target_landing`]), and fails the keys the driver
//! found altered ([`Core::handle_write_done_checked`]).

use super::*;

impl Core {
    /// Whether deposits take page digests (default on). Off only to measure
    /// what they cost: pages deposited meanwhile carry none, and a
    /// destination checks only the pages that come with one.
    pub fn set_page_digests(&mut self, on: bool) {
        self.page_digests = on;
    }

    /// Whether deposits take page digests.
    pub fn page_digests(&self) -> bool {
        self.page_digests
    }

    /// The digest of `key`'s page, if it is READY here and has one.
    pub fn page_digest(&self, key: &ScopedKey) -> Option<u64> {
        let entry = self.index.get(key)?;
        (entry.state == Residency::Ready)
            .then(|| self.record_digest(entry.record))
            .flatten()
    }

    pub(in crate::machine) fn record_digest(&self, idx: u32) -> Option<u64> {
        self.digests.get(idx as usize).copied().flatten()
    }

    pub(in crate::machine) fn set_record_digest(&mut self, idx: u32, digest: Option<u64>) {
        let at = idx as usize;
        if self.digests.len() <= at {
            if digest.is_none() {
                return;
            }
            self.digests.resize(at + 1, None);
        }
        if let Some(slot) = self.digests.get_mut(at) {
            *slot = digest;
        }
    }

    /// Sets the digest of the record fill `fill` is filling.
    pub(in crate::machine) fn set_fill_digest(&mut self, fill: u32, digest: Option<u64>) {
        if let Some(record) = self
            .fills
            .get(fill as usize)
            .and_then(Option::as_ref)
            .map(|f| f.record)
        {
            self.set_record_digest(record, digest);
        }
    }

    /// Where target operation `op`'s keys land: per key (in request
    /// order), its slots' address and length in layout order. `None` once
    /// the op is no longer awaited. The slots stay owned until the op's
    /// reply is handled, so the driver may hash them outside the lock.
    /// A one-hop operation's keys land in device memory: `None` (see
    /// [`Core::target_device_landing`]).
    pub fn target_landing(&self, op: OpHandle) -> Option<Vec<Vec<(u64, u64)>>> {
        let target_op = self.peer.as_ref()?.target.ops.get(&op)?;
        if !target_op.one_hop.is_empty() {
            return None;
        }
        let landing = target_op
            .fills
            .iter()
            .map(|fill| {
                let record = self.fills.get(*fill as usize)?.as_ref()?.record;
                Some(
                    self.slot_spans(record)
                        .into_iter()
                        .map(|s| (s.src, s.len))
                        .collect(),
                )
            })
            .collect::<Option<Vec<Vec<(u64, u64)>>>>()?;
        Some(landing)
    }

    /// A `write_done` (or what a record stands for) after the driver
    /// checked the landed bytes: `message` completes only the keys whose
    /// bytes matched, with the digests that matched; the keys of
    /// `mismatched` (indices into the op's keys) fail with
    /// [`FailReason::DigestMismatch`] and are counted. Nothing else
    /// differs from [`Core::handle_message`].
    pub fn handle_write_done_checked(&mut self, now: u64, message: Message, mismatched: &[u32]) {
        if let Body::WriteDone { op_handle, .. } = &message.body
            && !mismatched.is_empty()
        {
            self.landing_mismatch = Some((*op_handle, mismatched.to_vec()));
        }
        self.handle_message(now, message);
        self.landing_mismatch = None;
    }

    /// A one-hop operation's `write_done` after the driver hashed every
    /// completed key's landed device bytes ([`Core::target_device_landing`])
    /// and compared them with the key's digest: as
    /// [`Core::handle_write_done_checked`], and the keys that matched may
    /// succeed. A one-hop key handed any other way fails (fail closed).
    pub fn handle_one_hop_checked(&mut self, now: u64, message: Message, mismatched: &[u32]) {
        if let Body::WriteDone { op_handle, .. } = &message.body {
            self.landing_checked = Some(*op_handle);
        }
        self.handle_write_done_checked(now, message, mismatched);
        self.landing_checked = None;
    }

    /// Write `write`'s pages in the order its puts write them: per page,
    /// how many of the write's spans are its (consecutive, in layout order)
    /// and its digest, if every page has one. What a source's copy checks
    /// each page against as it moves it.
    pub fn peer_write_pages(&self, write: u64) -> Option<Vec<(usize, u64)>> {
        let w = self.peer.as_ref()?.source.writes.get(&write)?;
        w.records
            .iter()
            .map(|r| Some((self.slot_span_count(*r), self.record_digest(*r)?)))
            .collect()
    }

    /// A record completing `message`'s operation whose write digest is
    /// `combined`, sent by a source that hashed each page in the pass that
    /// copied it and found it as deposited, so the driver did not read the
    /// landed bytes again: its keys complete now, without their own digests,
    /// which the `write_done` behind the record brings
    /// ([`Core::handle_late_digests`]).
    pub fn handle_write_done_checked_in_copy(&mut self, now: u64, message: Message, combined: u64) {
        if let Body::WriteDone { op_handle, .. } = &message.body {
            self.landing_checked_in_copy = Some((*op_handle, combined));
        }
        self.handle_message(now, message);
        self.landing_checked_in_copy = None;
    }

    /// A `write_done` whose per-page digests combine to `combined` (the
    /// driver combines them; the core never hashes). For an operation a
    /// record completed without them
    /// ([`Core::handle_write_done_checked_in_copy`]), from its own source,
    /// naming exactly the keys that landed, and combining to the record's
    /// digest, each page still held as it landed takes its digest; else
    /// the message is handled as any other (an unknown operation's is
    /// refused).
    pub fn handle_late_digests(&mut self, now: u64, message: Message, combined: u64) {
        let Body::WriteDone {
            op_handle,
            outcome: WriteOutcome::Completed(completed),
        } = &message.body
        else {
            return self.handle_message(now, message);
        };
        let Some(late) = self.take_late_digests(*op_handle) else {
            return self.handle_message(now, message);
        };
        let from_source = late.source == message.header.sender_endpoint
            && late.source_incarnation == Some(message.header.sender);
        let indices: Vec<u32> = late.pages.iter().map(|p| p.0).collect();
        let (Some(digests), true, true) = (
            completed.digests(),
            from_source && late.combined == combined,
            completed.as_slice() == indices.as_slice(),
        ) else {
            // Not what the record stood for: the pages keep no digest.
            self.refuse();
            return;
        };
        for ((_, record, key), digest) in late.pages.iter().zip(digests) {
            let held = self
                .index
                .get(key)
                .is_some_and(|e| e.record == *record && e.state == Residency::Ready);
            if held && self.record_digest(*record).is_none() {
                self.set_record_digest(*record, Some(*digest));
            }
        }
    }

    fn take_late_digests(&mut self, op: OpHandle) -> Option<LateDigests> {
        let late = &mut self.peer.as_mut()?.target.late_digests;
        let at = late.iter().position(|l| l.op == op)?;
        late.remove(at)
    }

    /// Remembers that `op`'s landed `pages` wait for their digests.
    pub(in crate::machine) fn await_late_digests(
        &mut self,
        op: OpHandle,
        source: (ControlEndpoint, Option<Incarnation>),
        combined: u64,
        pages: Vec<(u32, u32, ScopedKey)>,
    ) {
        let Some(peer) = self.peer.as_mut() else {
            return;
        };
        let late = &mut peer.target.late_digests;
        if late.len() >= LATE_DIGESTS {
            late.pop_front();
        }
        late.push_back(LateDigests {
            op,
            source: source.0,
            source_incarnation: source.1,
            combined,
            pages,
        });
    }

    /// The digests of write `write`'s pages (in the order it writes them),
    /// if every one has a digest: what a record completing it carries.
    pub fn peer_write_digests(&self, write: u64) -> Option<Vec<u64>> {
        let pages = self.peer_write_pages(write)?;
        Some(pages.into_iter().map(|(_, digest)| digest).collect())
    }
}
