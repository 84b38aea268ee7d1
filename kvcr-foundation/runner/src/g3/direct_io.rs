//! The store's I/O entry points. Memory named by address is checked
//! against the store's [`MemoryRegistry`] (the runner's, whose pools and
//! engine regions are registered there; a caller of its own registers its
//! buffers in [`G3Store::memory`]); borrowed buffers need no registration.
//!
//! The system calls themselves (`flock`, `statx` for `STATX_DIOALIGN`, the
//! `pread`/`pwrite` loop that moves one slot) and [`DirectBuf`] live in
//! [`kvcr_sys::direct_io`]; the names below keep the paths the tier uses.

use std::sync::Arc;

use kvcr_sys::MemoryRegistry;
pub use kvcr_sys::direct_io::DirectBuf;
#[cfg(test)]
pub(super) use kvcr_sys::direct_io::limit_file_size;
pub(super) use kvcr_sys::direct_io::{Failure, dio_alignment, lock_exclusive};
use kvcr_sys::direct_io::{Transfer, read_into, write_from};

use super::pool::{Exec, Outcome};
use super::{Files, G3Error, G3Io, G3Op, G3SliceIo, G3Store};

/// The system call's direction for `op`.
fn direction(op: G3Op) -> Transfer {
    match op {
        G3Op::Read => Transfer::Read,
        G3Op::Write => Transfer::Write,
    }
}

/// Validates one item and moves its slot through `memory`.
fn execute(files: &Files, memory: &MemoryRegistry, item: &G3Io) -> Outcome {
    let (file, offset) = files.validate(item)?;
    let moved = memory
        .transfer(&file.file, direction(item.op), item.addr, item.len, offset)
        .map_err(|_| G3Error::Unregistered {
            slot: item.slot,
            addr: item.addr,
            len: item.len,
        })?;
    moved.map_err(|failure| files.failure(file, item, failure))
}

/// The executor the worker pool runs items with.
fn executor(files: &Arc<Files>, memory: &Arc<MemoryRegistry>) -> Exec {
    let (files, memory) = (Arc::clone(files), Arc::clone(memory));
    Arc::new(move |item: &G3Io| execute(&files, &memory, item))
}

impl G3Store {
    /// Moves whole slots between memory registered in [`G3Store::memory`]
    /// and the files, many at once: the calling thread and the store's
    /// workers claim items in order, so consecutive slots (consecutive
    /// files) run in parallel; returns every item's outcome, in order, once
    /// all have finished. A batch of one runs on the calling thread alone.
    /// Items are independent: one failing fails only itself. An item whose
    /// slot, length or alignment is wrong, or whose memory is not
    /// registered (for a read: not writable), touches nothing
    /// ([`G3Error::SlotRange`],
    /// [`G3Error::Buffer`],
    /// [`G3Error::Unregistered`]).
    ///
    /// Which item touches which bytes when is the caller's protocol (a
    /// read's range should overlap no other item's, and nobody else should
    /// touch it meanwhile), as for every copy through the registry.
    ///
    /// Hold no lock the workers' callers need: this blocks for the I/O.
    #[must_use]
    pub fn run_batch(&self, items: &[G3Io]) -> Vec<Outcome> {
        self.pool
            .run(items.to_vec(), executor(&self.files, &self.memory))
    }

    /// Queues `items` and returns at once; `done` is called with every
    /// item's outcome, in order, on the worker thread that finishes the last
    /// one (or now, on this thread, for an empty batch). `done` should be
    /// short (it delays the worker's next item) and must not drop the last
    /// owner of this store (its workers are joined on drop). A panic in
    /// `done` is caught and counted ([`G3Store::callback_panics`]). Memory
    /// as [`G3Store::run_batch`] (checked as each item runs).
    ///
    /// Dropping the store runs every submitted item and calls every `done`
    /// first.
    pub fn submit(&self, items: Vec<G3Io>, done: impl FnOnce(Vec<Outcome>) + Send + 'static) {
        self.pool
            .submit(items, executor(&self.files, &self.memory), Box::new(done));
    }

    /// Reads one slot into registered `addr..addr+len` on the calling
    /// thread: the one-block fill's path (one `pread`, no hand-off).
    pub fn read_slot(&self, slot: u64, addr: u64, len: u64) -> Outcome {
        execute(&self.files, &self.memory, &G3Io::read(slot, addr, len))
    }

    /// Writes one slot from registered `addr..addr+len` on the calling
    /// thread.
    pub fn write_slot(&self, slot: u64, addr: u64, len: u64) -> Outcome {
        execute(&self.files, &self.memory, &G3Io::write(slot, addr, len))
    }

    /// [`G3Store::read_slot`] into a borrowed buffer (one slot long, aligned
    /// to [`G3Store::alignment`]).
    pub fn read_slot_into(&self, slot: u64, dst: &mut [u8]) -> Outcome {
        let item = G3Io::read(slot, dst.as_mut_ptr() as usize as u64, dst.len() as u64);
        let (file, offset) = self.files.validate(&item)?;
        read_into(&file.file, dst, offset).map_err(|f| self.files.failure(file, &item, f))
    }

    /// [`G3Store::write_slot`] from a borrowed buffer (one slot long,
    /// aligned to [`G3Store::alignment`]).
    pub fn write_slot_from(&self, slot: u64, src: &[u8]) -> Outcome {
        let item = G3Io::write(slot, src.as_ptr() as usize as u64, src.len() as u64);
        let (file, offset) = self.files.validate(&item)?;
        write_from(&file.file, src, offset).map_err(|f| self.files.failure(file, &item, f))
    }

    /// [`G3Store::run_batch`] over borrowed buffers (lent to the store's
    /// registry for the call).
    #[must_use]
    pub fn run_batch_slices(&self, items: &mut [G3SliceIo<'_>]) -> Vec<Outcome> {
        let raw: Vec<G3Io> = items
            .iter()
            .map(|item| match item {
                G3SliceIo::Read { slot, dst } => {
                    G3Io::read(*slot, dst.as_ptr() as usize as u64, dst.len() as u64)
                }
                G3SliceIo::Write { slot, src } => {
                    G3Io::write(*slot, src.as_ptr() as usize as u64, src.len() as u64)
                }
            })
            .collect();
        let mut writable: Vec<&mut [u8]> = Vec::new();
        let mut readable: Vec<&[u8]> = Vec::new();
        for item in items.iter_mut() {
            match item {
                G3SliceIo::Read { dst, .. } => writable.push(dst),
                G3SliceIo::Write { src, .. } => readable.push(src),
            }
        }
        // Reads' buffers are borrowed exclusively (so they overlap nothing),
        // writes' shared (so nobody writes them); `run_batch` returns only
        // after every item has finished, inside the loan.
        self.memory
            .lend(&mut writable, &readable, || self.run_batch(&raw))
            .unwrap_or_else(|_| {
                raw.iter()
                    .map(|item| {
                        Err(G3Error::Unregistered {
                            slot: item.slot,
                            addr: item.addr,
                            len: item.len,
                        })
                    })
                    .collect()
            })
    }
}
