//! Completions and requests read from shared memory: the `write_done`
//! records sources ring in our doorbell (as their target), and the
//! `start_write` requests targets post to our mailboxes in their doorbell
//! files (as their source). Both reach the core as that session's messages.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use kvcr_contracts::protocol::{Body, Message};

use super::State;
use crate::shared::Shared;
use crate::wire::mailbox::Polled;

/// Hands `taken` (messages read from shared memory: doorbell records or
/// mailbox requests, each with its session's identity) to the core in one
/// lock, and counts them and the `refused` ones in `(taken, refused)`.
/// `true`: there was one.
fn hand_to_core(
    shared: &Arc<Shared>,
    taken: Vec<(Message, Option<super::landing::Sent>)>,
    refused: u64,
    (taken_count, refused_count): (&AtomicU64, &AtomicU64),
) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    refused_count.fetch_add(refused, Relaxed);
    if taken.is_empty() {
        return false;
    }
    taken_count.fetch_add(taken.len() as u64, Relaxed);
    // A doorbell record's landed bytes are hashed first, outside the lock.
    let taken: Vec<super::landing::Checked> = taken
        .into_iter()
        .map(|(message, sent)| match sent {
            Some(sent) => super::landing::check(shared, message, sent),
            None => super::landing::Checked::unchecked(message),
        })
        .collect();
    shared.with_core_now(|core, now| {
        for checked in taken {
            checked.hand(core, now);
        }
    });
    true
}

impl State {
    /// Handles the requests our targets posted to our mailboxes in their
    /// doorbell files (as their source) ahead of their copies on the control
    /// sessions: a record that verifies under the route's session key,
    /// decodes as a `start_write`, and is that session's next message (see
    /// `crate::wire`), as from the identity the session proved. `true`:
    /// one was handled.
    pub(super) fn take_requests(&mut self, shared: &Arc<Shared>) -> bool {
        let mut taken = Vec::new();
        let mut refused = 0u64;
        for (target, route) in &self.routes {
            let Some((mailbox, session)) = &route.mailbox else {
                continue;
            };
            let (index, frame) = match mailbox.poll() {
                Polled::Quiet => continue,
                Polled::Refused => {
                    refused += 1;
                    continue;
                }
                Polled::Request { index, frame } => (index, frame),
            };
            let Some(mut message) = self
                .control
                .decode(&frame)
                .filter(|m| matches!(m.body, Body::StartWrite { .. }))
            else {
                refused += 1;
                continue;
            };
            // Not the session's next message (one before it is unread, or
            // its copy came first): the session brings it.
            let Some(incarnation) = self.control.take_early(target, *session, index) else {
                continue;
            };
            message.header.sender_endpoint = target.clone();
            message.header.sender = incarnation;
            taken.push(message);
        }
        let stats = &self.control.stats;
        let counters = (
            &stats.mailbox_requests_taken,
            &stats.mailbox_requests_refused,
        );
        let taken = taken.into_iter().map(|m| (m, None)).collect();
        hand_to_core(shared, taken, refused, counters)
    }

    /// Takes the `write_done`s our doorbell's watched slots hold.
    pub(super) fn take_doorbells(&mut self, shared: &Arc<Shared>) {
        let control = &self.control;
        let (taken, refused) = self.doorbell.take(|source| control.dialed_peer(source));
        let stats = &self.control.stats;
        let counters = (&stats.doorbells_taken, &stats.doorbells_refused);
        let mut checked_in_copy = 0;
        let taken = taken
            .into_iter()
            .map(|(m, digest, checked)| {
                let sent = match digest {
                    Some(digest)
                        if checked && self.trusts_copy_check(&m.header.sender_endpoint) =>
                    {
                        checked_in_copy += 1;
                        super::landing::Sent::CheckedInCopy(digest)
                    }
                    _ => super::landing::Sent::Write(digest),
                };
                (m, Some(sent))
            })
            .collect();
        stats
            .landings_checked_in_copy
            .fetch_add(checked_in_copy, std::sync::atomic::Ordering::Relaxed);
        hand_to_core(shared, taken, refused, counters);
    }
}
