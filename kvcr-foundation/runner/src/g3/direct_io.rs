//! The store's raw-memory I/O entry points (whose callers promise the
//! memory) and the safe slice wrappers over them.
//!
//! The system calls themselves (`flock`, `statx` for `STATX_DIOALIGN`, the
//! `pread`/`pwrite` loop that moves one slot) and [`DirectBuf`] live in
//! [`kvcr_sys::direct_io`]; the names below keep the paths the tier uses.

use std::sync::Arc;

pub use kvcr_sys::direct_io::DirectBuf;
#[cfg(test)]
pub(super) use kvcr_sys::direct_io::limit_file_size;
pub(super) use kvcr_sys::direct_io::{Failure, dio_alignment, lock_exclusive};
use kvcr_sys::direct_io::{Transfer, transfer};

use super::pool::{Exec, Outcome};
use super::{Files, G3Io, G3Op, G3SliceIo, G3Store};

/// The system call's direction for `op`.
fn direction(op: G3Op) -> Transfer {
    match op {
        G3Op::Read => Transfer::Read,
        G3Op::Write => Transfer::Write,
    }
}

/// Validates one item and moves its slot.
///
/// # Safety
/// The item's memory as [`G3Store::run_batch`] requires, for the call.
unsafe fn execute(files: &Files, item: &G3Io) -> Outcome {
    let (file, offset) = files.validate(item)?;
    // SAFETY: `validate` checked the length (one slot) and the alignment;
    // the memory itself is this function's contract.
    let result = unsafe { transfer(&file.file, direction(item.op), item.addr, item.len, offset) };
    result.map_err(|failure| files.failure(file, item, failure))
}

/// The executor the worker pool runs items with.
///
/// Built only inside the `unsafe` entry points below, whose callers promise
/// every item's memory until the batch is over.
fn executor(files: &Arc<Files>) -> Exec {
    let files = Arc::clone(files);
    Arc::new(move |item: &G3Io| {
        // SAFETY: this executor runs only items of a batch submitted through
        // `run_batch` or `submit`, before that batch is over; their callers
        // promised the memory until then (their `# Safety`).
        unsafe { execute(&files, item) }
    })
}

impl G3Store {
    /// Moves whole slots between caller memory and the files, many at once:
    /// the calling thread and the store's workers claim items in order, so
    /// consecutive slots (consecutive files) run in parallel; returns every
    /// item's outcome, in order, once all have finished. A batch of one runs
    /// on the calling thread alone. Items are independent: one failing fails
    /// only itself. An item whose slot, length or alignment is wrong touches
    /// nothing ([`G3Error::SlotRange`](super::G3Error::SlotRange),
    /// [`G3Error::Buffer`](super::G3Error::Buffer)).
    ///
    /// Hold no lock the workers' callers need: this blocks for the I/O.
    ///
    /// # Safety
    /// Until this call returns, for every item:
    /// 1. `addr..addr+len` is valid memory: writable for a
    ///    [`G3Op::Read`], readable for a [`G3Op::Write`];
    /// 2. nobody else accesses a read's range, or writes a write's range;
    /// 3. a read's range overlaps no other item's range.
    #[must_use]
    pub unsafe fn run_batch(&self, items: &[G3Io]) -> Vec<Outcome> {
        self.pool.run(items.to_vec(), executor(&self.files))
    }

    /// Queues `items` and returns at once; `done` is called with every
    /// item's outcome, in order, on the worker thread that finishes the last
    /// one (or now, on this thread, for an empty batch). `done` should be
    /// short (it delays the worker's next item) and must not drop the last
    /// owner of this store (its workers are joined on drop). A panic in
    /// `done` is caught and counted ([`G3Store::callback_panics`]).
    ///
    /// Dropping the store runs every submitted item and calls every `done`
    /// first.
    ///
    /// # Safety
    /// As [`G3Store::run_batch`], until `done` has been called.
    pub unsafe fn submit(
        &self,
        items: Vec<G3Io>,
        done: impl FnOnce(Vec<Outcome>) + Send + 'static,
    ) {
        self.pool
            .submit(items, executor(&self.files), Box::new(done));
    }

    /// Reads one slot into `addr..addr+len` on the calling thread: the
    /// one-block fill's path (one `pread`, no hand-off).
    ///
    /// # Safety
    /// `addr..addr+len` is valid for writes and accessed by nobody else
    /// until this returns.
    pub unsafe fn read_slot(&self, slot: u64, addr: u64, len: u64) -> Outcome {
        // SAFETY: this function's contract.
        unsafe { execute(&self.files, &G3Io::read(slot, addr, len)) }
    }

    /// Writes one slot from `addr..addr+len` on the calling thread.
    ///
    /// # Safety
    /// `addr..addr+len` is valid for reads and written by nobody until this
    /// returns.
    pub unsafe fn write_slot(&self, slot: u64, addr: u64, len: u64) -> Outcome {
        // SAFETY: this function's contract.
        unsafe { execute(&self.files, &G3Io::write(slot, addr, len)) }
    }

    /// [`G3Store::read_slot`] into a borrowed buffer (one slot long, aligned
    /// to [`G3Store::alignment`]).
    pub fn read_slot_into(&self, slot: u64, dst: &mut [u8]) -> Outcome {
        // SAFETY: `dst` is borrowed exclusively for the call.
        unsafe { self.read_slot(slot, dst.as_mut_ptr() as usize as u64, dst.len() as u64) }
    }

    /// [`G3Store::write_slot`] from a borrowed buffer (one slot long,
    /// aligned to [`G3Store::alignment`]).
    pub fn write_slot_from(&self, slot: u64, src: &[u8]) -> Outcome {
        // SAFETY: `src` is borrowed (so not written) for the call.
        unsafe { self.write_slot(slot, src.as_ptr() as usize as u64, src.len() as u64) }
    }

    /// [`G3Store::run_batch`] over borrowed buffers.
    #[must_use]
    pub fn run_batch_slices(&self, items: &mut [G3SliceIo<'_>]) -> Vec<Outcome> {
        let raw: Vec<G3Io> = items
            .iter_mut()
            .map(|item| match item {
                G3SliceIo::Read { slot, dst } => {
                    G3Io::read(*slot, dst.as_mut_ptr() as usize as u64, dst.len() as u64)
                }
                G3SliceIo::Write { slot, src } => {
                    G3Io::write(*slot, src.as_ptr() as usize as u64, src.len() as u64)
                }
            })
            .collect();
        // SAFETY: every buffer is borrowed for the call, reads' exclusively
        // (so they overlap nothing), writes' shared (so nobody writes them);
        // `run_batch` returns only after every item has finished.
        unsafe { self.run_batch(&raw) }
    }
}
