//! Mailbox numbering: the messages of one accepted control session,
//! counted alike on both ends, so a request read early from the sender's
//! mailbox is handled once, in the order sent, and its copy on the session
//! is dropped when it comes. Sans-I/O: the channel feeds it what the socket
//! brought and what the mailbox offered.

use std::collections::VecDeque;

/// Most messages of one session taken early whose copies have not come on
/// the session yet; past it, none more is taken early (the session brings
/// them as before).
pub(crate) const MAX_TAKEN_EARLY: usize = 64;

/// The messages of one accepted session, numbered from 0 in the order its
/// peer sent them: those read from the socket, and those taken early from
/// the peer's mailbox (see [`super::mailbox`]), whose copies are dropped
/// when the socket brings them. Sans-I/O: each message is handled once, in
/// the order sent, whichever way it came first.
#[derive(Debug, Default)]
pub(crate) struct MessageCount {
    /// Messages read from the socket (the next one's index).
    read: u64,
    /// Indexes from `read` on whose messages were taken early, in order.
    taken_early: VecDeque<u64>,
}

/// What to do with a message read from a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// Handle it.
    Handle,
    /// It was taken early: drop it.
    Drop,
}

impl MessageCount {
    /// The index the session's next message will have, counting those
    /// taken early.
    fn next_index(&self) -> u64 {
        self.taken_early.back().map_or(self.read, |last| last + 1)
    }

    /// Whether message `index`, found early, may be handled now: only the
    /// session's next message, and only while fewer than
    /// [`MAX_TAKEN_EARLY`] wait for their copies. `true` records it.
    pub(crate) fn take_early(&mut self, index: u64) -> bool {
        if self.next_index() != index || self.taken_early.len() >= MAX_TAKEN_EARLY {
            return false;
        }
        self.taken_early.push_back(index);
        true
    }

    /// The session brought its next message.
    pub(crate) fn arrived(&mut self) -> Arrival {
        let index = self.read;
        self.read += 1;
        if self.taken_early.front() == Some(&index) {
            self.taken_early.pop_front();
            Arrival::Drop
        } else {
            Arrival::Handle
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Arrival, MAX_TAKEN_EARLY, MessageCount};
    use proptest::prelude::*;

    /// What happens next to a session of `sent` messages: its socket brings
    /// the next one, or a mailbox offers some index (honest, stale,
    /// replayed or from the future).
    #[derive(Debug, Clone)]
    enum Step {
        Socket,
        Mailbox(u64),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            prop_oneof![
                3 => Just(Step::Socket),
                2 => (0u64..80).prop_map(Step::Mailbox),
            ],
            0..400,
        )
    }

    proptest! {
        /// However socket arrivals and mailbox offers interleave, every
        /// message is handled exactly once and in the order sent: an early
        /// take is only ever the next unhandled message, and the copy of a
        /// message taken early is what gets dropped.
        #[test]
        fn every_message_is_handled_once_in_order(steps in steps(), sent in 0u64..80) {
            let mut count = MessageCount::default();
            let mut arrived = 0u64;
            let mut handled: Vec<u64> = Vec::new();
            for step in steps {
                match step {
                    Step::Socket if arrived < sent => {
                        let index = arrived;
                        arrived += 1;
                        if count.arrived() == Arrival::Handle {
                            handled.push(index);
                        }
                    }
                    Step::Socket => {}
                    // A mailbox only holds messages that were sent.
                    Step::Mailbox(index) if index < sent => {
                        if count.take_early(index) {
                            handled.push(index);
                        }
                    }
                    Step::Mailbox(_) => {}
                }
                prop_assert!(count.taken_early.len() <= MAX_TAKEN_EARLY);
            }
            // The socket brings the rest.
            while arrived < sent {
                let index = arrived;
                arrived += 1;
                if count.arrived() == Arrival::Handle {
                    handled.push(index);
                }
            }
            prop_assert_eq!(handled, (0..sent).collect::<Vec<_>>());
            prop_assert!(count.taken_early.is_empty());
        }
    }
}
