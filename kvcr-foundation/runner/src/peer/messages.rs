//! Write messages: a small write through UCX leaves as active messages
//! (parts, each with its own sealed header) that carry the bytes and the
//! write's completion together; as a target, the parts that verify are
//! copied into the operation's granted slots as they land, and the last is
//! handled as the write's `write_done`.

use std::collections::VecDeque;
use std::sync::Arc;

use kvcr_runner_core::PutSpan;
use kvcr_ucx::Completion;

use super::State;
use super::puts::pool_holding;
use super::routes::Route;
use crate::shared::Shared;
use crate::wire::part::{Part, PartFit};

/// Most write messages (parts) held between a worker progress and their
/// handling (received from anyone; each is dropped unread if it does not
/// verify): with [`PeerOptions::WRITE_MESSAGE_LIMIT`], at most 16 MiB of
/// UCX's receive buffers wait on us. One progress call delivers what one
/// read of the socket held (a 256 KiB receive segment: four 64 KiB parts),
/// and they are taken after each.
pub(super) const MAX_HELD_MESSAGES: usize = 64;

impl State {
    /// Sends write `write` as a message, when it may go as one: its route
    /// has the target's record key, it is small enough, and it carries
    /// the first keys asked for (the only completion a record states). Its
    /// bytes leave in parts of at most `write_message_part_bytes`, each
    /// with its own header, so the target copies each part as it lands
    /// (UCX reassembles a message from its segments before anyone sees
    /// it). `None`: nothing left, it goes as puts; otherwise the sends that
    /// left, and whether every part did (a write missing some fails as a
    /// failed put would).
    pub(super) fn send_as_message(
        &self,
        shared: &Arc<Shared>,
        write: u64,
        route: &Route,
        spans: &[PutSpan],
    ) -> Option<(VecDeque<Completion>, bool)> {
        let (key, _) = route.session_key.as_ref()?;
        let endpoint = route.ucx_endpoint()?;
        let bytes = spans
            .iter()
            .try_fold(0u64, |sum, s| sum.checked_add(s.len))?;
        if bytes > self.write_message_max_bytes {
            return None;
        }
        let count = Part::cut(bytes, self.write_message_part_bytes)?;
        let (op, keys, digest) = super::landing::write_record(&shared.lock().core, write)?;
        let local: Vec<(u64, u64)> = spans.iter().map(|s| (s.local, s.len)).collect();
        let mut sent = VecDeque::with_capacity(usize::from(count));
        for index in 0..count {
            // Any refusal here is made before this part left (a bounds
            // check), so the parts sent so far say what left.
            let one = Part::new(index, count).and_then(|part| {
                let parts = crate::wire::part::spans_in_range(&local, part.range(bytes)?)
                    .into_iter()
                    .map(|(at, len)| {
                        let (pool, offset) = pool_holding(&self.pools, at, len)?;
                        Some((
                            pool,
                            usize::try_from(offset).ok()?,
                            usize::try_from(len).ok()?,
                        ))
                    })
                    .collect::<Option<Vec<_>>>()?;
                let header = key.seal_message_digested(op, keys, part, digest);
                endpoint
                    .send_message(crate::wire::record::WRITE_MESSAGE, &header, &parts)
                    .ok()
            });
            match one {
                Some(c) => sent.push_back(c),
                None if sent.is_empty() => return None,
                None => return Some((sent, false)),
            }
        }
        Some((sent, true))
    }

    /// Takes the write messages the worker received (`messages`): a part that verifies
    /// as its session's message for an operation we wait on, fits what has
    /// landed of it (a part lands once; all parts agree on the keys and the
    /// cut), and carries exactly its share of that operation's granted
    /// bytes is copied there; the last part is handled as the write's
    /// `write_done`. Anything else is dropped unread.
    pub(super) fn take_write_messages(
        &mut self,
        shared: &Arc<Shared>,
        messages: Vec<kvcr_ucx::ActiveMessage>,
    ) {
        let stats = &self.control.stats;
        // Those the worker dropped at its bounds were refused unread too.
        let dropped = self.worker.dropped_messages();
        stats.write_messages_refused.fetch_add(
            dropped.saturating_sub(self.messages_dropped),
            std::sync::atomic::Ordering::Relaxed,
        );
        self.messages_dropped = dropped;
        for message in messages {
            let control = &self.control;
            let doorbell = &mut self.doorbell;
            let taken = doorbell
                .open_message(message.header(), |source| control.dialed_peer(source))
                .and_then(|opened| {
                    let fit = doorbell.fit_part(&opened);
                    if fit == PartFit::Refused {
                        return None;
                    }
                    let data = message.data();
                    shared.with_core_now(|core, now| {
                        // Under the core lock: the granted slots are this
                        // operation's while it waits for its reply (a part
                        // arriving after its deadline finds none).
                        let spans = core.peer_landing_spans(opened.op, opened.keys)?;
                        let pieces = opened.part_pieces(&spans, data.len() as u64)?;
                        // The data, cut into this part's pieces of the spans
                        // in order (their lengths sum to its length, checked
                        // above), each landed through the registry. Every
                        // destination is a piece of an element of one of our
                        // pools (resolved by the core's region table),
                        // granted to operation `op`, whose FILLING slot
                        // nothing else reads or writes while the operation
                        // waits for its reply (checked just above for this
                        // part, under this same lock; the last part's reply
                        // is handled below, still under it).
                        let mut from = 0usize;
                        for (dst, len) in pieces {
                            let to = from.checked_add(usize::try_from(len).ok()?)?;
                            shared.memory.write(dst, data.get(from..to)?).ok()?;
                            from = to;
                        }
                        doorbell.land_part(&opened);
                        // Counted before the operation completes: whoever
                        // it wakes sees the count.
                        stats
                            .write_messages_taken
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if fit == PartFit::Last {
                            let sent = super::landing::Sent::Write(opened.digest);
                            let memory = &shared.memory;
                            super::landing::hand_checked(core, now, memory, opened.done, sent);
                            doorbell.forget_op(opened.op);
                        }
                        Some(())
                    })
                });
            if taken.is_none() {
                stats
                    .write_messages_refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}
