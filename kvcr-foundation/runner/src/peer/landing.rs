//! The destination's check of a write's landed bytes before its completion
//! reaches the core: each completed key's slots are hashed (xxh3-64, see
//! `kvcr_sys::digest`) and compared with the digest the source sent, per
//! key in a `write_done`, or as one digest of the whole write in a sealed
//! record (a doorbell slot, a write message's or a data stream frame's
//! header). A key whose bytes differ fails `FailReason::DigestMismatch` and
//! is counted (`digest_mismatches`); its slots are freed as a failed key's
//! are, never seated.
//!
//! A doorbell record may say the source hashed each page in the pass that
//! copied it into our mapped pools and found it as deposited (its lanes
//! check every page of a one-copy write against its deposit digest): then,
//! unless [`crate::LandingCheck::Always`], the landed bytes are not read
//! again. The source's CPU stored them straight into our pools, with no
//! wire between its check and our memory, so a second read here would
//! catch nothing the source's check did not. The pages' own digests come
//! with the `write_done` behind the record ([`Hand::Late`]).
//!
//! The hashing runs outside the core's lock where the caller can ([`check`],
//! then [`Checked::hand`] under it): an awaited operation's slots are freed
//! only by its reply, which this peer thread hands over after. A large write
//! is hashed on several threads, its keys split among them. A one-hop
//! completion's bytes are on the device: `device_check` hashes those.

use kvcr_contracts::protocol::{Body, CompletedIndices, Message, OpHandle, WriteOutcome};
use kvcr_runner_core::Core;
use kvcr_sys::{MemoryRegistry, combine_digests};

use crate::shared::Shared;

/// Whether a target reads the bytes a same-host source wrote into its
/// mapped pools again before it completes their keys (a
/// [`crate::PeerOptions`] field).
///
/// A one-copy write's source hashes each page in the pass that copies it
/// and compares it with the digest taken at deposit; a page that differs
/// fails the write. Its CPU stores the bytes straight into the target's
/// pools, with no wire between that check and the target's memory, so by
/// default the target trusts the check its record reports and does not
/// read the pages again (a restore's only pass over them is the copy). A
/// source that lies about its check could as well write wrong bytes with
/// their digest: the second read guards against no member (see
/// `docs/trust.md`). Every other route (UCX puts, write messages, data
/// streams) is always checked here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LandingCheck {
    /// Pages a same-host source checked in its copy are not read again.
    #[default]
    TrustCopyCheck,
    /// Every landed page is read again and compared with its digest here,
    /// whatever the source checked (a second pass over each page).
    Always,
}

/// What digest came with a completion.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sent {
    /// A `write_done`: per key, inside it (or none); `trust_copy_check`:
    /// from a source that maps our pools, and [`LandingCheck`] trusts a
    /// check it made in its copy.
    PerKey { trust_copy_check: bool },
    /// A sealed record: one digest of the write's pages, or none.
    Write(Option<u64>),
    /// A doorbell record whose write's pages the source checked as it
    /// copied them, with the write's digest: nothing is read here.
    CheckedInCopy(u64),
}

/// How a completion reaches the core.
enum Hand {
    /// Its keys whose landed bytes did not match (none: all did, or there
    /// was nothing to check).
    Checked(Vec<u32>),
    /// A one-hop completion whose every key's device bytes were hashed:
    /// those that did not match.
    OneHop(Vec<u32>),
    /// Completed by a record of pages the source checked in its copy, whose
    /// write's digest is this.
    CheckedInCopy(u64),
    /// A `write_done` for an operation no longer awaited, with per-page
    /// digests that combine to this: maybe the digests a record's
    /// completion left behind.
    Late(u64),
}

/// A completion whose landed bytes were checked: the message to hand to the
/// core (completing only the keys that matched) and the keys that did not.
pub(crate) struct Checked {
    message: Message,
    hand: Hand,
    /// Taken as checked in the source's copy, not read here.
    trusted: bool,
}

impl Checked {
    /// A message with nothing to check (handed on as it is).
    pub(crate) fn unchecked(message: Message) -> Self {
        Self {
            message,
            hand: Hand::Checked(Vec::new()),
            trusted: false,
        }
    }

    /// A one-hop completion whose every key's device bytes were hashed,
    /// `mismatched` those that did not match.
    pub(crate) fn one_hop(message: Message, mismatched: Vec<u32>) -> Self {
        Self {
            message,
            hand: Hand::OneHop(mismatched),
            trusted: false,
        }
    }

    /// The keys a one-hop check found wrong (`None`: not handed as a
    /// one-hop check; an unchecked completion with no mismatch is `None` too).
    #[cfg(test)]
    pub(crate) fn one_hop_mismatched(&self) -> Option<&[u32]> {
        match &self.hand {
            Hand::OneHop(mismatched) => Some(mismatched),
            Hand::Checked(mismatched) if mismatched.is_empty() => None,
            _ => panic!("handed as another route's check"),
        }
    }

    /// Whether its pages were taken as checked in the source's copy.
    pub(crate) fn trusted_copy_check(&self) -> bool {
        self.trusted
    }

    /// Hands the completion to the core (under its lock).
    pub(crate) fn hand(self, core: &mut Core, now: u64) {
        match self.hand {
            Hand::Checked(mismatched) => {
                core.handle_write_done_checked(now, self.message, &mismatched);
            }
            Hand::OneHop(mismatched) => {
                core.handle_one_hop_checked(now, self.message, &mismatched);
            }
            Hand::CheckedInCopy(combined) => {
                core.handle_write_done_checked_in_copy(now, self.message, combined);
            }
            Hand::Late(combined) => core.handle_late_digests(now, self.message, combined),
        }
    }
}

/// Checks `message`'s landed bytes against the digests `sent` with it,
/// taking the core's lock only to learn where they landed.
pub(crate) fn check(shared: &Shared, message: Message, sent: Sent) -> Checked {
    match super::device_check::check_device(shared, message) {
        Ok(checked) => checked,
        Err(message) => check_in_memory(shared, *message, sent),
    }
}

/// As [`check`], for a message known not to complete a one-hop operation
/// (its bytes landed in our registered memory, if anywhere).
pub(crate) fn check_in_memory(shared: &Shared, message: Message, sent: Sent) -> Checked {
    check_with(&shared.memory, message, sent, |op| {
        shared.lock().core.target_landing(op)
    })
}

/// As [`check`] then [`Checked::hand`], for a caller already under the
/// core's lock.
pub(crate) fn hand_checked(
    core: &mut Core,
    now: u64,
    memory: &MemoryRegistry,
    message: Message,
    sent: Sent,
) {
    check_with(memory, message, sent, |op| core.target_landing(op)).hand(core, now);
}

fn check_with(
    memory: &MemoryRegistry,
    message: Message,
    sent: Sent,
    landing: impl FnOnce(OpHandle) -> Option<Vec<Vec<(u64, u64)>>>,
) -> Checked {
    let unchecked = Checked::unchecked;
    let (op_handle, completed) = match &message.body {
        Body::WriteDone {
            op_handle,
            outcome: WriteOutcome::Completed(completed),
        } => (*op_handle, completed),
        _ => return unchecked(message),
    };
    let expected = match (sent, completed.digests()) {
        (Sent::CheckedInCopy(combined), _) => {
            return Checked {
                message,
                hand: Hand::CheckedInCopy(combined),
                trusted: true,
            };
        }
        (Sent::PerKey { .. }, Some(digests)) => Expected::PerKey(digests.to_vec()),
        (Sent::Write(Some(digest)), _) => Expected::Write(digest),
        // Nothing to check against (the source keeps no digests).
        _ => return unchecked(message),
    };
    // An op that is not awaited: the core refuses or ignores it, unless a
    // record completed it and its pages wait for these digests.
    let Some(landing) = landing(op_handle) else {
        return match expected {
            Expected::PerKey(digests) => Checked {
                message,
                hand: Hand::Late(combine_digests(&digests)),
                trusted: false,
            },
            Expected::Write(_) => unchecked(message),
        };
    };
    if let Sent::PerKey {
        trust_copy_check: true,
    } = sent
        && completed.is_checked_in_copy()
    {
        // The digests it carries are the pages' own: kept as they are.
        return Checked {
            trusted: true,
            ..unchecked(message)
        };
    }
    let (checked, mismatched) = compare(memory, completed, &expected, &landing);
    Checked {
        message: Message {
            header: message.header,
            body: Body::WriteDone {
                op_handle,
                outcome: WriteOutcome::Completed(checked),
            },
        },
        hand: Hand::Checked(mismatched),
        trusted: false,
    }
}

enum Expected {
    PerKey(Vec<u64>),
    Write(u64),
}

/// Writes at least this large are hashed on several threads.
const SPLIT_BYTES: u64 = 16 << 20;

/// The completed keys whose landed bytes match (with their digests) and
/// those that do not.
fn compare(
    memory: &MemoryRegistry,
    completed: &CompletedIndices,
    expected: &Expected,
    landing: &[Vec<(u64, u64)>],
) -> (CompletedIndices, Vec<u32>) {
    let keys: Vec<Option<&[(u64, u64)]>> = completed
        .as_slice()
        .iter()
        .map(|index| landing.get(*index as usize).map(Vec::as_slice))
        .collect();
    let found = digests_of(memory, &keys);
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

/// Each key's digest (`None`: no landing, or unregistered), on up to the
/// lanes' count of threads for a large write.
fn digests_of(memory: &MemoryRegistry, keys: &[Option<&[(u64, u64)]>]) -> Vec<Option<u64>> {
    let threads = crate::copy::plan::default_lanes();
    crate::copy::plan::page_digests(memory, keys, SPLIT_BYTES, threads)
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

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use kvcr_contracts::protocol::{Header, RouteGeneration};
    use kvcr_contracts::{ControlEndpoint, Incarnation};

    use super::*;
    use crate::copy::test_memory::TestBuffer;

    /// A `write_done` for op 1 completing keys 0 and 1 with `digests`, said
    /// checked in the source's copy or not.
    pub(crate) fn write_done(digests: [u64; 2], checked_in_copy: bool) -> Message {
        let completed = CompletedIndices::with_digests(vec![(0, digests[0]), (1, digests[1])]);
        let completed = if checked_in_copy {
            completed.checked_in_copy()
        } else {
            completed
        };
        Message {
            header: Header {
                sender: Incarnation::from_raw(7).unwrap(),
                route_generation: RouteGeneration(0),
                sender_endpoint: ControlEndpoint::parse("tcp://127.0.0.1:9").unwrap(),
            },
            body: Body::WriteDone {
                op_handle: OpHandle(1),
                outcome: WriteOutcome::Completed(completed),
            },
        }
    }

    /// A `write_done` claiming a check in the source's copy is taken
    /// unread only where the caller trusts that source's check (it maps our
    /// pools, and the policy allows it); otherwise the landed bytes are
    /// read, and a key whose bytes differ from its digest fails, whatever
    /// the source claimed.
    #[rstest::rstest]
    #[case::trusted(true, true, Vec::new())]
    #[case::claim_from_a_source_not_trusted(false, true, vec![1])]
    #[case::no_claim(true, false, vec![1])]
    fn a_copy_check_is_trusted_only_where_allowed(
        #[case] trust_copy_check: bool,
        #[case] claimed: bool,
        #[case] failed: Vec<u32>,
    ) {
        let registry = Arc::new(MemoryRegistry::new());
        let pages: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
        let buffer = TestBuffer::with(&registry, 8192, &pages);
        let base = buffer.addr();
        let first = kvcr_sys::digest::digest_bytes(&pages[..4096]);
        // Key 1's digest is not its landed bytes'.
        let message = write_done([first, 0xbad], claimed);
        let landing = vec![vec![(base, 4096)], vec![(base + 4096, 4096)]];
        let checked = check_with(
            &registry,
            message,
            Sent::PerKey { trust_copy_check },
            |_| Some(landing),
        );
        assert_eq!(checked.trusted_copy_check(), failed.is_empty());
        match checked.hand {
            Hand::Checked(mismatched) => assert_eq!(mismatched, failed),
            _ => panic!("handed as a landing check"),
        }
    }
}
