//! The destination's check of a write's landed bytes before its completion
//! reaches the core: each completed key's slots are hashed (xxh3-64, see
//! `kvcr_sys::digest`) and compared with the digest the source sent, per
//! key in a `write_done`, or as one digest of the whole write in a sealed
//! record (a doorbell slot, a write message's or a data stream frame's
//! header). A key whose bytes differ fails with
//! `FailReason::DigestMismatch` and is counted (`digest_mismatches`); its
//! slots are freed as a failed key's are, never seated.

use kvcr_contracts::protocol::{Body, CompletedIndices, Message, OpHandle, WriteOutcome};
use kvcr_runner_core::Core;
use kvcr_sys::{MemoryRegistry, combine_digests};

/// What digest came with a completion.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sent {
    /// A `write_done`: per key, inside it (or none).
    PerKey,
    /// A sealed record: one digest of the write's pages, or none.
    Write(Option<u64>),
}

/// Hands `message` to the core, after checking the landed bytes of a
/// completed write against the digests `sent` with it. Called under the
/// core's lock: the op's slots stay owned until this reply is handled.
pub(crate) fn hand_checked(
    core: &mut Core,
    now: u64,
    memory: &MemoryRegistry,
    message: Message,
    sent: Sent,
) {
    let Message { header, body } = message;
    let (op_handle, completed) = match body {
        Body::WriteDone {
            op_handle,
            outcome: WriteOutcome::Completed(completed),
        } => (op_handle, completed),
        body => return core.handle_message(now, Message { header, body }),
    };
    let per_key = completed.digests().map(<[u64]>::to_vec);
    let expected = match (sent, per_key) {
        (Sent::PerKey, Some(digests)) => Some(Expected::PerKey(digests)),
        (Sent::Write(Some(digest)), _) => Some(Expected::Write(digest)),
        _ => None,
    };
    let landing = core.target_landing(op_handle);
    let (checked, mismatched) = match (expected, landing) {
        (Some(expected), Some(landing)) => check(memory, &completed, &expected, &landing),
        // Nothing to check against (no digests kept), or an op that is not
        // awaited (the core refuses or ignores it).
        _ => (completed, Vec::new()),
    };
    let message = Message {
        header,
        body: Body::WriteDone {
            op_handle,
            outcome: WriteOutcome::Completed(checked),
        },
    };
    core.handle_write_done_checked(now, message, &mismatched);
}

enum Expected {
    PerKey(Vec<u64>),
    Write(u64),
}

/// The completed keys whose landed bytes match (with their digests) and
/// those that do not.
fn check(
    memory: &MemoryRegistry,
    completed: &CompletedIndices,
    expected: &Expected,
    landing: &[Vec<(u64, u64)>],
) -> (CompletedIndices, Vec<u32>) {
    let found: Vec<Option<u64>> = completed
        .as_slice()
        .iter()
        .map(|index| {
            let spans = landing.get(*index as usize)?;
            memory.digest(spans).ok()
        })
        .collect();
    let matches: Vec<bool> = match expected {
        Expected::PerKey(sent) => found
            .iter()
            .zip(sent)
            .map(|(found, sent)| *found == Some(*sent))
            .collect(),
        Expected::Write(sent) => {
            let all: Option<Vec<u64>> = found.iter().copied().collect();
            let whole = all.is_some_and(|all| combine_digests(&all) == *sent);
            vec![whole; found.len()]
        }
    };
    let mut passed = Vec::new();
    let mut mismatched = Vec::new();
    for ((index, found), ok) in completed.as_slice().iter().zip(found).zip(matches) {
        match (ok, found) {
            (true, Some(digest)) => passed.push((*index, digest)),
            _ => mismatched.push(*index),
        }
    }
    (CompletedIndices::with_digests(passed), mismatched)
}

/// What a record completing source write `write` says: the target's op,
/// how many keys, and the digest of their pages (when each has one).
pub(crate) fn write_record(core: &Core, write: u64) -> Option<(OpHandle, u32, Option<u64>)> {
    let (op, keys) = core.peer_write_completion(write)?;
    let digest = core
        .peer_write_digests(write)
        .map(|digests| combine_digests(&digests));
    Some((op, keys, digest))
}
