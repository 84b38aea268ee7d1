//! Who the replay ROUTER is answering, and how many reply bytes ZMQ may still
//! hold for them: sans-I/O, the driver makes the sends.
//!
//! A reply is streamed, never queued whole. The ROUTER's send high-water mark
//! is one message per peer ([`PEER_SEND_HWM`]) and a send to a peer whose pipe
//! is full fails instead of queueing (`ROUTER_MANDATORY`). So when ZMQ accepts
//! a message for a peer, the one before the previous has left the process:
//! ZMQ holds at most a peer's last two accepted messages, and their sizes are
//! what the peer is charged. A peer that never reads stops at two messages;
//! one that reads is charged a sliding pair and its reply goes on.
//!
//! Bounds ([`ReplayLimits`](crate::ReplayLimits)): the charges of every peer
//! together stay under a byte cap (a send that would pass it waits), and at
//! most a fixed number of replies are in progress at once. A new requester
//! past it takes the place of the reply whose peer has gone longest without
//! reading (that peer is owed an end marker), or, when every peer reads, gets
//! an empty replay (the end marker alone). A reply ends at the newest batch
//! buffered when it was asked for, so a live stream cannot make it longer. A
//! peer no longer answered stays charged for what ZMQ may still hold for it
//! until a send finds it gone or the connections it could be on are
//! ([`ReplayPeers::reclaim`]).

use std::collections::{HashMap, VecDeque};

use crate::core::Transmit;
use crate::replay::ReplayBuffer;

/// The replay ROUTER's send high-water mark, in messages per peer.
pub(crate) const PEER_SEND_HWM: i32 = 1;

// A `Charge` covers the high-water mark plus the message ZMQ's I/O thread is
// writing: two messages.
const _: () = assert!(PEER_SEND_HWM == 1);

/// Messages sent to one peer per pump before the next peer's turn.
const BURST: usize = 256;

/// The bytes charged for the end marker's frames (`""`, `""`, 8 bytes, `""`).
const END_BYTES: usize = 8;

/// What goes to a peer next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Outgoing<'a> {
    /// One buffered batch: `[identity, "", topic, seq, payload]`.
    Batch(&'a Transmit),
    /// The end marker `[identity, "", "", 0xff × 8, ""]`.
    End,
}

/// What ZMQ did with a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sent {
    /// Queued for the peer.
    Accepted,
    /// The peer's pipe is full (it has not read): nothing was queued.
    Full,
    /// The peer is not connected (any more): nothing was queued.
    Gone,
}

/// What the last two accepted messages to a peer weigh, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Charge {
    older: usize,
    newer: usize,
}

impl Charge {
    fn total(self) -> usize {
        self.older + self.newer
    }
}

#[derive(Debug)]
struct Reply {
    identity: Vec<u8>,
    /// The next sequence to send.
    next: u64,
    /// One past the last sequence of this reply.
    end: u64,
    charge: Charge,
    /// The pump that last had a message of this reply accepted.
    last_accepted: u64,
    /// Whether its peer's pipe was full at its last turn (not reading).
    stalled: bool,
}

/// Whether a request is being answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// A reply is in progress for it (a new one, or the peer's earlier one
    /// restarted from the new start).
    Answering,
    /// A reply in progress was given up for it: its peer, which had not
    /// read for longest, is owed the end marker.
    Displaced,
    /// Too many replies are in progress, all of them read: the peer gets
    /// only the end marker.
    Refused,
}

/// What one pump did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Pumped {
    /// Messages ZMQ accepted (batches and end markers).
    pub(crate) accepted: u64,
    /// Batches among them.
    pub(crate) batches: u64,
    /// Replies that reached their end marker.
    pub(crate) finished: u64,
    /// Replies dropped because their peer left mid-reply.
    pub(crate) abandoned: u64,
    /// Replies that skipped batches evicted from the buffer while waiting.
    pub(crate) truncated: u64,
}

/// The replay peers and what they are charged.
#[derive(Debug)]
pub(crate) struct ReplayPeers {
    max_replies: usize,
    cap: usize,
    /// Replies in progress, in turn order.
    replies: VecDeque<Reply>,
    /// Peers no longer answered and what ZMQ may still hold for them.
    answered: HashMap<Vec<u8>, Charge>,
    /// Peers owed an end marker (refused or displaced), oldest first.
    owed_ends: VecDeque<Vec<u8>>,
    /// Pumps so far.
    pumps: u64,
    queued: usize,
    peak: usize,
    /// Connections open on the ROUTER (accepted minus disconnected).
    connections: u64,
}

impl ReplayPeers {
    /// At most `max_replies` replies at once, `cap` bytes charged in all.
    pub(crate) fn new(max_replies: usize, cap: usize) -> Self {
        Self {
            max_replies,
            cap,
            replies: VecDeque::new(),
            answered: HashMap::new(),
            owed_ends: VecDeque::new(),
            pumps: 0,
            queued: 0,
            peak: 0,
            connections: 0,
        }
    }

    /// Bytes ZMQ may hold for all peers (an upper bound).
    pub(crate) fn queued_bytes(&self) -> usize {
        self.queued
    }

    /// The largest [`Self::queued_bytes`] so far.
    pub(crate) fn peak_bytes(&self) -> usize {
        self.peak
    }

    /// Replies in progress.
    pub(crate) fn open_replies(&self) -> usize {
        self.replies.len()
    }

    /// Whether end markers are owed to peers that have not taken them yet.
    pub(crate) fn owes_ends(&self) -> bool {
        !self.owed_ends.is_empty()
    }

    /// Replies in progress whose peer was not reading at their last turn.
    pub(crate) fn stalled_replies(&self) -> usize {
        self.replies.iter().filter(|r| r.stalled).count()
    }

    /// A request from `identity` for every buffered batch from `start`.
    pub(crate) fn request(
        &mut self,
        identity: Vec<u8>,
        start: u64,
        buffer: &ReplayBuffer,
    ) -> Admission {
        let end = buffer.oldest().map_or(start, |o| o + buffer.len() as u64);
        if let Some(reply) = self.replies.iter_mut().find(|r| r.identity == identity) {
            reply.next = start;
            reply.end = end;
            return Admission::Answering;
        }
        let mut admission = Admission::Answering;
        if self.replies.len() >= self.max_replies {
            let longest_unread = self
                .replies
                .iter()
                .enumerate()
                .filter(|(_, r)| r.stalled)
                .min_by_key(|(_, r)| r.last_accepted)
                .map(|(i, _)| i);
            let Some(displaced) = longest_unread.and_then(|i| self.replies.remove(i)) else {
                self.owe_end(identity);
                return Admission::Refused;
            };
            self.answered
                .insert(displaced.identity.clone(), displaced.charge);
            self.owe_end(displaced.identity);
            admission = Admission::Displaced;
        }
        let charge = self.answered.remove(&identity).unwrap_or_default();
        self.owed_ends.retain(|owed| *owed != identity);
        self.replies.push_back(Reply {
            identity,
            next: start,
            end,
            charge,
            last_accepted: self.pumps,
            stalled: false,
        });
        admission
    }

    /// Owes `identity` an end marker; the list is as long as the reply cap at
    /// most (past it the oldest debt is dropped: that peer was not reading).
    fn owe_end(&mut self, identity: Vec<u8>) {
        if !self.owed_ends.contains(&identity) {
            if self.owed_ends.len() >= self.max_replies {
                self.owed_ends.pop_front();
            }
            self.owed_ends.push_back(identity);
        }
    }

    /// Sends the end markers owed, where the peer takes them. They are not
    /// held back by the byte cap (a few bytes each, at most `max_replies`
    /// owed), but are charged like any message.
    fn pay_ends(&mut self, send: &mut impl FnMut(&[u8], Outgoing<'_>) -> Sent) {
        for _ in 0..self.owed_ends.len() {
            let Some(identity) = self.owed_ends.pop_front() else {
                break;
            };
            match send(&identity, Outgoing::End) {
                Sent::Full => self.owed_ends.push_back(identity),
                Sent::Gone => {
                    if let Some(charge) = self.answered.remove(&identity) {
                        self.queued -= charge.total();
                    }
                }
                Sent::Accepted => {
                    let bytes = identity.len() + END_BYTES;
                    let charge = self.answered.entry(identity).or_default();
                    // Accepted after the newer: the older has left ZMQ.
                    self.queued = self.queued - charge.older + bytes;
                    self.peak = self.peak.max(self.queued);
                    *charge = Charge {
                        older: charge.newer,
                        newer: bytes,
                    };
                }
            }
        }
    }

    /// Sends what the byte cap allows, a turn per reply; `send` does the I/O.
    pub(crate) fn pump(
        &mut self,
        buffer: &ReplayBuffer,
        mut send: impl FnMut(&[u8], Outgoing<'_>) -> Sent,
    ) -> Pumped {
        let mut out = Pumped::default();
        self.pumps += 1;
        self.pay_ends(&mut send);
        for _ in 0..self.replies.len() {
            let Some(mut reply) = self.replies.pop_front() else {
                break;
            };
            match self.turn(&mut reply, buffer, &mut send, &mut out) {
                Turn::Waiting => self.replies.push_back(reply),
                Turn::Finished => {
                    out.finished += 1;
                    self.answered.insert(reply.identity, reply.charge);
                }
                Turn::Gone => {
                    out.abandoned += 1;
                    self.queued -= reply.charge.total();
                }
            }
        }
        out
    }

    fn turn(
        &mut self,
        reply: &mut Reply,
        buffer: &ReplayBuffer,
        send: &mut impl FnMut(&[u8], Outgoing<'_>) -> Sent,
        out: &mut Pumped,
    ) -> Turn {
        for _ in 0..BURST {
            if let Some(oldest) = buffer.oldest()
                && reply.next < oldest
                && reply.next < reply.end
            {
                // Evicted while the reply waited (or asked for): answered
                // from the oldest buffered batch, as vLLM does.
                reply.next = oldest;
                out.truncated += 1;
            }
            let outgoing = match buffer.get(reply.next) {
                Some(t) if reply.next < reply.end => Outgoing::Batch(t),
                _ => Outgoing::End,
            };
            let bytes = reply.identity.len()
                + match outgoing {
                    Outgoing::Batch(t) => t.topic.len() + 8 + t.payload.len(),
                    Outgoing::End => END_BYTES,
                };
            let others = self.queued - reply.charge.total();
            let after = others + reply.charge.newer + bytes;
            if after > self.cap && others > 0 {
                return Turn::Waiting;
            }
            match send(&reply.identity, outgoing) {
                Sent::Full => {
                    reply.stalled = true;
                    return Turn::Waiting;
                }
                Sent::Gone => return Turn::Gone,
                Sent::Accepted => {}
            }
            reply.stalled = false;
            reply.last_accepted = self.pumps;
            // The older message has left ZMQ: it accepted one after the newer.
            reply.charge = Charge {
                older: reply.charge.newer,
                newer: bytes,
            };
            self.queued = after;
            self.peak = self.peak.max(after);
            out.accepted += 1;
            match outgoing {
                Outgoing::Batch(_) => {
                    out.batches += 1;
                    reply.next += 1;
                }
                Outgoing::End => return Turn::Finished,
            }
        }
        Turn::Waiting
    }

    /// A connection to the ROUTER opened (`true`) or closed (`false`).
    pub(crate) fn connection(&mut self, opened: bool) {
        if opened {
            self.connections += 1;
        } else {
            self.connections = self.connections.saturating_sub(1);
        }
    }

    /// Forgets answered peers that cannot all still be connected. Each
    /// connection is one peer, so with `a` answered peers on record and `c`
    /// connections, at least `a - c` answered peers are gone (replies in
    /// progress may be among the connected ones; each learns of its own
    /// peer's departure at its next send), though which is unknown.
    /// Forgetting the `a - c` smallest answered charges leaves a sum that
    /// still covers every answered peer that is connected. No connection at
    /// all forgets every peer.
    pub(crate) fn reclaim(&mut self) {
        if self.connections == 0 {
            self.replies.clear();
            self.answered.clear();
            self.owed_ends.clear();
            self.queued = 0;
            return;
        }
        let Some(gone) = (self.answered.len() as u64)
            .checked_sub(self.connections)
            .filter(|&g| g > 0)
        else {
            return;
        };
        let mut charges: Vec<(usize, &Vec<u8>)> = self
            .answered
            .iter()
            .map(|(id, c)| (c.total(), id))
            .collect();
        charges.sort_by_key(|&(bytes, _)| bytes);
        let forget: Vec<Vec<u8>> = charges
            .into_iter()
            .take(usize::try_from(gone).unwrap_or(usize::MAX))
            .map(|(_, id)| id.clone())
            .collect();
        for id in forget {
            if let Some(charge) = self.answered.remove(&id) {
                self.queued -= charge.total();
            }
        }
    }
}

enum Turn {
    Waiting,
    Finished,
    Gone,
}
