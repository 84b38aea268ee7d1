//! The runner's side of G3: the core's [`Action::G3`](kvcr_runner_core::Action)
//! jobs run on the [`G3Store`]'s workers, and their outcomes come back to
//! the core like a copy job's (`handle_copy_done`), on the worker that
//! finished the job's last transfer.
//!
//! Drop order: the runner stops this driver (joining the store's workers,
//! after every submitted transfer ran and reported) before it frees the
//! pools the transfers read and write.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use kvcr_runner_core::{CopyOutcome, G3Direction, G3Transfer, JobId};

use kvcr_sys::MemoryRegistry;

use kvcr_sys::mapping::AnonMapping;
use kvcr_sys::{ByteSpan, RegisteredMemory};

use crate::g3::{G3Error, G3Io, G3Store};
use crate::shared::Shared;

/// What G3's I/O reported, beside the core's counters.
#[derive(Debug, Default)]
pub(crate) struct G3IoStats {
    pub(crate) failed_transfers: AtomicU64,
    /// Keys read whose bytes did not match the digest they were spilled
    /// with (also counted by the core, in `G3Counters::digest_mismatches`).
    pub(crate) digest_mismatches: AtomicU64,
    pub(crate) last_error: Mutex<Option<G3Error>>,
}

/// The store and what its I/O reported.
pub(crate) struct G3Driver {
    store: G3Store,
    stats: Arc<G3IoStats>,
    /// The runner's registered memory: bounce buffers are copied out
    /// through it.
    memory: Arc<MemoryRegistry>,
}

impl G3Driver {
    /// The driver of `store`, whose transfers go through `memory` (the
    /// runner's registry: its pools and the engine's regions).
    pub(crate) fn new(mut store: G3Store, memory: Arc<MemoryRegistry>) -> Self {
        store.use_memory(Arc::clone(&memory));
        Self {
            store,
            stats: Arc::new(G3IoStats::default()),
            memory,
        }
    }

    pub(crate) fn stats(&self) -> &Arc<G3IoStats> {
        &self.stats
    }

    /// Starts job `job`'s transfers (per key, one per span); reports the job
    /// to `shared` when all ended, a key copied only if all its spans were.
    ///
    /// A load into memory the files cannot read into directly (a deliver
    /// destination off the direct-I/O alignment) goes through a bounce
    /// buffer of its own, copied out before the job is reported.
    ///
    /// A key with a digest in `digests` (a read of a page spilled with
    /// one) is checked once its bytes are in place: bytes altered in the
    /// file are reported [`CopyOutcome::Altered`], never served.
    pub(crate) fn submit(
        &self,
        shared: Weak<Shared>,
        job: JobId,
        keys: &[Vec<G3Transfer>],
        digests: Vec<Option<u64>>,
    ) {
        let spans: Vec<usize> = keys.iter().map(Vec::len).collect();
        // Where each checked key's bytes land (its loads, in span order).
        let landing: Vec<Vec<(u64, u64)>> = keys
            .iter()
            .map(|key| key.iter().map(|t| (t.addr, t.len)).collect())
            .collect();
        let align = self.store.alignment().max(1);
        // (transfer, bounce, destination, slot, length) per bounced load.
        let mut bounces: Vec<(usize, RegisteredMemory, u64, u64, u64)> = Vec::new();
        let mut items = Vec::with_capacity(spans.iter().sum());
        for (i, t) in keys.iter().flatten().enumerate() {
            let item = match t.direction {
                G3Direction::Store => G3Io::write(u64::from(t.slot), t.addr, t.len),
                G3Direction::Load if t.addr % align == 0 => {
                    G3Io::read(u64::from(t.slot), t.addr, t.len)
                }
                G3Direction::Load => {
                    match bounce(&self.memory, t.len, align) {
                        Some(bounce) => {
                            let item = G3Io::read(u64::from(t.slot), bounce.base(), t.len);
                            bounces.push((i, bounce, t.addr, u64::from(t.slot), t.len));
                            item
                        }
                        // No memory for a bounce: the store refuses the
                        // unaligned item itself (a typed error, nothing read).
                        None => G3Io::read(u64::from(t.slot), t.addr, t.len),
                    }
                }
            };
            items.push(item);
        }
        let stats = Arc::clone(&self.stats);
        let memory = Arc::clone(&self.memory);
        let done = move |mut outcomes: Vec<Result<(), G3Error>>| {
            for (i, bounce, dest, slot, len) in &bounces {
                if let Some(outcome @ Ok(())) = outcomes.get_mut(*i) {
                    // `dest .. dest + len` is the deliver destination of
                    // this transfer (a registered engine region), which the
                    // core keeps for this job until its outcome is reported
                    // (below), and which no other transfer of a live job
                    // writes; the bounce buffer is this job's own.
                    if memory
                        .copy([ByteSpan::new(bounce.base(), *dest, *len)])
                        .is_err()
                    {
                        // Unreachable while the core and the registry agree.
                        *outcome = Err(G3Error::Unregistered {
                            slot: *slot,
                            addr: *dest,
                            len: *len,
                        });
                    }
                }
            }
            drop(bounces);
            let mut outcomes = outcomes.into_iter();
            let outcomes: Vec<CopyOutcome> = spans
                .iter()
                .map(|n| {
                    let mut key = CopyOutcome::Copied;
                    for outcome in outcomes.by_ref().take(*n) {
                        if let Err(e) = outcome {
                            stats.failed_transfers.fetch_add(1, Ordering::Relaxed);
                            *stats
                                .last_error
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner) = Some(e);
                            key = CopyOutcome::Failed;
                        }
                    }
                    key
                })
                .collect();
            let outcomes: Vec<CopyOutcome> = outcomes
                .into_iter()
                .zip(&landing)
                .enumerate()
                .map(|(i, (outcome, spans))| {
                    let expected = digests.get(i).copied().flatten();
                    match (outcome, expected) {
                        (CopyOutcome::Copied, Some(expected))
                            if memory.digest(spans).ok() != Some(expected) =>
                        {
                            stats.digest_mismatches.fetch_add(1, Ordering::Relaxed);
                            CopyOutcome::Altered
                        }
                        (outcome, _) => outcome,
                    }
                })
                .collect();
            // The runner is gone: nothing waits for these any more.
            if let Some(shared) = shared.upgrade() {
                shared.copy_done(job, &outcomes);
            }
        };
        // Every transfer is one whole slot of a runner pool (or a bounce
        // buffer, lent to the registry until the job's callback ran) that
        // the core keeps reserved for this job until its outcome is
        // reported (`handle_copy_done`, from `done`): a store reads a READY
        // slot held by an internal claim, a load writes a FILLING slot no one
        // else reads or writes until it commits or is freed, and no two
        // transfers of live jobs share a slot. The store checks each against
        // the registry.
        self.store.submit(items, done);
    }
}

/// A bounce buffer of `len` bytes aligned to `align`: a zeroed, pre-faulted
/// anonymous mapping held in `memory` (so the store may read into it and
/// the job copy out of it) until the returned handle drops. `None`: no
/// memory, or a mapping not aligned enough (beyond a page).
fn bounce(memory: &Arc<MemoryRegistry>, len: u64, align: u64) -> Option<RegisteredMemory> {
    let (mapping, _) = AnonMapping::new(len, &Default::default(), true).ok()?;
    if !(mapping.as_ptr() as usize as u64).is_multiple_of(align) {
        return None;
    }
    memory.hold(Arc::new(mapping)).ok()
}
