//! The replay side, sans-I/O: a bounded buffer of sent batches and the vLLM
//! 0.33 replay request/reply framing.
//!
//! Request (as a ROUTER sees it): `[identity, "", start_seq (8 bytes BE)]`.
//! Reply: `[identity, "", topic, seq (8 bytes BE), payload]` for every batch
//! buffered when the request arrived with `seq >= start_seq`, then the end marker
//! `[identity, "", "", 0xff × 8, ""]`. Any buffered sequence can be asked for,
//! any number of times, so a consumer that saw a gap resynchronises from what is
//! buffered instead of retiring the source. Replies are streamed under the
//! bounds of [`crate::ReplayLimits`]: never queued whole.

use std::collections::VecDeque;

use crate::core::Transmit;

/// The end-of-replay sequence frame: `-1` as a signed 8-byte big-endian integer.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Sent batches kept for replay, bounded by count and by payload bytes.
#[derive(Debug)]
pub struct ReplayBuffer {
    max_batches: usize,
    max_bytes: usize,
    bytes: usize,
    batches: VecDeque<Transmit>,
}

impl ReplayBuffer {
    /// A buffer keeping at most `max_batches` batches and `max_bytes` payload
    /// bytes (the newest batch is always kept, even alone over `max_bytes`).
    pub fn new(max_batches: usize, max_bytes: usize) -> Self {
        Self {
            max_batches,
            max_bytes,
            bytes: 0,
            batches: VecDeque::new(),
        }
    }

    /// Keeps `t`, evicting the oldest batches beyond the bounds.
    pub fn push(&mut self, t: Transmit) {
        if self.max_batches == 0 {
            return;
        }
        self.bytes += t.payload.len();
        self.batches.push_back(t);
        while self.batches.len() > self.max_batches
            || (self.bytes > self.max_bytes && self.batches.len() > 1)
        {
            match self.batches.pop_front() {
                Some(old) => self.bytes -= old.payload.len(),
                None => break,
            }
        }
    }

    /// Buffered batches with `seq >= start`, oldest first.
    pub fn from_seq(&self, start: u64) -> impl Iterator<Item = &Transmit> {
        // Sequence numbers are contiguous, so the position is arithmetic.
        let skip = match self.batches.front() {
            Some(first) => usize::try_from(start.saturating_sub(first.seq)).unwrap_or(usize::MAX),
            None => 0,
        };
        self.batches.iter().skip(skip)
    }

    /// The buffered batch with sequence `seq`, if it is still buffered.
    pub fn get(&self, seq: u64) -> Option<&Transmit> {
        let first = self.batches.front()?.seq;
        let index = usize::try_from(seq.checked_sub(first)?).ok()?;
        self.batches.get(index)
    }

    /// The oldest buffered sequence number.
    pub fn oldest(&self) -> Option<u64> {
        self.batches.front().map(|t| t.seq)
    }

    /// Batches buffered.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Payload bytes buffered.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A well-formed replay request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayRequest {
    /// The ROUTER identity to answer.
    pub identity: Vec<u8>,
    /// First sequence wanted.
    pub start_seq: u64,
}

/// Parses the frames a ROUTER received; anything but
/// `[identity, "", 8-byte start]` is `None` (ignored and counted by the caller).
pub fn parse_request(mut frames: Vec<Vec<u8>>) -> Option<ReplayRequest> {
    if frames.len() != 3 {
        return None;
    }
    let start = frames.pop()?;
    let delimiter = frames.pop()?;
    let identity = frames.pop()?;
    if !delimiter.is_empty() || identity.is_empty() {
        return None;
    }
    let start: [u8; 8] = start.as_slice().try_into().ok()?;
    Some(ReplayRequest {
        identity,
        start_seq: u64::from_be_bytes(start),
    })
}
