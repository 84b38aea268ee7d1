//! Arbitrary frames to the publisher's replay-request decoder
//! (`replay::parse_request`, what its ROUTER socket receives), checked
//! against the framing rule `[identity, "", start_seq (8 bytes BE)]`; a
//! decoded start then selects from a replay buffer, which must yield exactly
//! the buffered batches at or after it, in order.
//!
//! Input: one byte of frame count (0..=7), then per frame one length byte and
//! that many bytes; what is left over is appended to the last frame.
#![no_main]

use bytes::Bytes;
use kvcr_publisher::core::Transmit;
use kvcr_publisher::replay::{ReplayBuffer, parse_request};
use libfuzzer_sys::fuzz_target;

fn frames(data: &[u8]) -> Vec<Vec<u8>> {
    let Some((&count, mut rest)) = data.split_first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for _ in 0..(count % 8) {
        let Some((&len, tail)) = rest.split_first() else {
            out.push(Vec::new());
            continue;
        };
        let n = usize::from(len).min(tail.len());
        out.push(tail[..n].to_vec());
        rest = &tail[n..];
    }
    if let Some(last) = out.last_mut() {
        last.extend_from_slice(rest);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let frames = frames(data);
    let well_formed =
        frames.len() == 3 && !frames[0].is_empty() && frames[1].is_empty() && frames[2].len() == 8;
    let request = parse_request(frames.clone());
    assert_eq!(request.is_some(), well_formed);
    let Some(request) = request else {
        return;
    };
    assert_eq!(request.identity, frames[0]);
    assert_eq!(
        request.start_seq.to_be_bytes().as_slice(),
        frames[2].as_slice()
    );

    // A buffer of contiguous sequence numbers around the requested start.
    let first = request.start_seq.saturating_sub(3);
    let mut buffer = ReplayBuffer::new(5, 1 << 20);
    for seq in first..first.saturating_add(7) {
        buffer.push(Transmit {
            topic: Bytes::from_static(b"kv"),
            seq,
            payload: Bytes::from(seq.to_be_bytes().to_vec()),
        });
    }
    let oldest = buffer.oldest().unwrap_or(0);
    let sent: Vec<u64> = buffer.from_seq(request.start_seq).map(|t| t.seq).collect();
    let expected: Vec<u64> = (oldest..first.saturating_add(7))
        .filter(|s| *s >= request.start_seq)
        .collect();
    assert_eq!(sent, expected);
});
