//! G3: the file tier under KVCR DRAM (issue 22), its bottom layer.
//!
//! A [`G3Store`] owns a set of files, each opened `O_DIRECT | O_RDWR |
//! O_CLOEXEC` and locked exclusively, and numbers their slots: slot `i` lives
//! in file `i % n` at offset `(i / n) * slot_bytes`, so consecutive slots sit
//! in different files and a large spill or fill keeps every file busy. It
//! moves whole slots between caller memory and the files, with no bounce
//! buffer: the caller's memory must be aligned for direct I/O (the runner's
//! DRAM pool slots are page-aligned), or the item fails with
//! [`G3Error::Buffer`] and nothing moves.
//!
//! ```text
//!  caller ── run_batch(items) ──► calling thread + workers claim items in order ──► pread/pwrite per slot
//!     ▲                                   (file i % n, offset (i / n) × slot)             │
//!     └───────────── per-item outcomes, in order, once every item finished ◄──────────────┘
//!  caller ── submit(items, done) ──► the same, and the last worker calls done(outcomes)
//!  caller ── read_slot / write_slot ──► one pread/pwrite on the calling thread (one-block fills)
//! ```
//!
//! The store knows nothing of keys, residencies or eviction: which slot holds
//! what is the core's business. It starts empty every time (nothing is
//! recovered from a file's old contents) and reports every failure per item,
//! typed ([`G3Error`]).
//!
//! # Opening
//! [`G3Store::open`] refuses, with the path named: an empty path list; a path
//! whose parent directory does not resolve; a directory another user owns
//! or may write ([`G3Error::SharedDirectory`]: group or other write
//! permission, sticky or not; the rule and why are in `local_users`); two
//! paths that are one file (the directory is canonicalised, the file's own
//! name never is; then by device and inode); a symlink as the file's own
//! name (opened `O_NOFOLLOW` in the checked directory's descriptor: `ELOOP`);
//! anything but a regular file (a missing file is created `O_EXCL`, mode
//! 0600); a file that existed and is another user's
//! ([`G3Error::NotOwned`]) or that group or others may read or write
//! ([`G3Error::Exposed`]), both read on the opened descriptor; a file with
//! more than one hard link; a file another open file description has locked
//! (`flock(LOCK_EX | LOCK_NB)`, so a second store, in this process or another,
//! is refused with [`G3Error::Locked`]); a filesystem that refuses
//! `O_DIRECT`; a slot size that is zero or not a multiple of a file's
//! direct-I/O offset alignment (`statx(STATX_DIOALIGN)`, 4096 where the
//! kernel does not report it); a capacity per file that is zero or not a
//! multiple of the slot size. A refused open closes what it opened, which
//! releases those locks (a file it created stays, empty).
//!
//! # Decisions
//! Measured on the 2-vCPU VM (ext4 on virtio, about 1.1 GB/s for one
//! `dd iflag=direct bs=4M` reader; load average 1.6–1.9 from neighbours):
//! 3 files, 294 slots of 3.5 MiB (one Qwen3-0.6B 64-token page shard at
//! TP=2; 1.005 GiB), `cargo bench -p kvcr-foundation --bench g3` and a
//! scratch io_uring twin over the same files, medians of 5 rounds.
//! - **Worker threads, not io_uring.** Spill / fill through the store
//!   (6 workers plus the caller): 4.06 / 2.58 GB/s, 0.08 s of CPU per round
//!   (2 GiB moved); one io_uring ring (crate `io-uring` 0.7) at queue depth
//!   3 / 6 / 12: 3.86 / 4.10 / 4.04 GB/s writing, 2.43 / 2.56 / 2.59 reading,
//!   0.08 s of CPU per round at depth 6; one 3.5 MiB read, p50: `pread`
//!   1202 µs, io_uring 1212 µs. Equal, so no new dependency and no ring to
//!   own: a slot is one multi-megabyte `pread`/`pwrite`, which the kernel
//!   splits into device requests itself, and a syscall plus a thread hand-off
//!   per slot is noise beside it. The worker count hardly matters here
//!   (1 / 2 / 3 / 6 / 12 workers: spill 3.3–4.1 GB/s, fill 2.2–2.7, each
//!   within noise of its anchor); the default, two per file, keeps a few
//!   requests in flight on every file for faster devices.
//! - **No preallocation by default** ([`G3Sizing::Grow`]): a file grows as
//!   slots are written, so a full disk surfaces as [`G3Error::NoSpace`] on
//!   the write that hit it, never as a refused open. Spill into fresh files:
//!   growing 2.64 GB/s, sparse (`ftruncate` to the capacity,
//!   [`G3Sizing::Sparse`]) 2.71, `fallocate`d 2.83 (its extents are still
//!   "unwritten" and converted on first write), against 4.21 overwriting
//!   written blocks. Sparse is harmless but buys nothing; `fallocate` would
//!   claim the whole capacity up front (a full disk would refuse the open)
//!   for 7 %; writing the capacity once at open would take it to overwrite
//!   speed but costs the capacity's write time at every start. A tier that
//!   has spilled once runs at overwrite speed.
//! - **No `fdatasync`.** A write is complete when `pwrite` returned: with
//!   `O_DIRECT` the bytes left the page cache for the device, and any later
//!   read through the store returns them. The tier is process-scoped (it
//!   starts empty, nothing is recovered after a crash), so "READY in G3 only
//!   after the write is durable for the process" is exactly "after the write
//!   completed"; surviving a power loss would need the device cache flushed
//!   and the file's metadata committed (`fdatasync`), which no reader of
//!   this tier needs. [`G3Store::sync_data`] is there for a caller that
//!   does.
//! - **`flock`, not `fcntl` locks.** A `flock` belongs to the open file
//!   description, so a second store in the same process is refused too
//!   (process-owned `fcntl` locks would let it in, and closing any
//!   descriptor of the file would drop them). One consequence: a process
//!   forked by another thread while a store is open shares the locked
//!   description until its `exec` closes it (`O_CLOEXEC`), so for that
//!   moment the file stays locked after the store closed.
//!
//! # A file removed underneath
//! On Linux an open descriptor keeps working after its file is unlinked: the
//! store's I/O goes on succeeding against an inode no path reaches (its
//! blocks are freed when the store closes). What the store detects, and
//! how: [`G3Store::check`] `fstat`s every file (`st_nlink == 0`:
//! [`G3Gone::Unlinked`]) and `stat`s its path (another inode or none:
//! [`G3Gone::PathElsewhere`]); a failed read or write whose file has
//! `st_nlink == 0` reports [`G3Error::FileGone`] (naming the slot and the
//! failure's errno) instead of the plain failure. The driver calls `check`
//! periodically and after failures, and retires the tier when it reports.
//!
//! # Drop order
//! The store's workers are joined first (after running every submitted item
//! and calling every callback), then the files are closed, which releases
//! their locks (field order in [`G3Store`]).

mod direct_io;
pub(crate) mod driver;
mod error;
mod open;
mod pool;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use self::direct_io::DirectBuf;
pub use self::error::{G3Error, G3Gone, G3Op};
use self::open::path_error;
use self::pool::WorkerPool;

/// The alignment assumed where the kernel does not report one.
pub const DEFAULT_DIO_ALIGN: u64 = 4096;

/// Most files one store opens.
pub const MAX_FILES: usize = 4096;

/// Most worker threads one store starts.
pub const MAX_WORKERS: usize = 64;

/// Which files the G3 tier uses and how much of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct G3Options {
    /// The files, in stripe order (created if missing). Each must be a
    /// distinct regular file with one link.
    pub paths: Vec<PathBuf>,
    /// Bytes of each file the tier uses: a non-zero multiple of the slot
    /// size.
    pub capacity_bytes_per_file: u64,
}

/// What [`G3Store::open_with`] does to a file's length at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum G3Sizing {
    /// Leave it: a file grows as slots are written, so a full disk surfaces
    /// as [`G3Error::NoSpace`] on the write that hits it. Reading a slot
    /// never written past the end of the file is [`G3Error::ShortIo`].
    #[default]
    Grow,
    /// Extend a shorter file to the capacity with `ftruncate`: a sparse file
    /// (no blocks are allocated, so a full disk still surfaces on write);
    /// a slot never written reads as zeros.
    Sparse,
}

/// How a store runs its I/O (defaults suit the measured machines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct G3Tuning {
    /// Worker threads (0: two per file, at least 2, at most 16).
    ///
    /// Threads, not io_uring: one slot is one `pread`/`pwrite` of a whole
    /// page (megabytes), which the kernel splits into device requests
    /// itself, so a few blocking calls in flight per file fill the device;
    /// per-item cost is a syscall and a thread hand-off, noise beside a
    /// 3.5 MiB transfer. The numbers that decided it are in the module docs.
    /// The caller of [`G3Store::run_batch`] runs items too, so a batch has
    /// one more request in flight than there are workers.
    pub workers: usize,
    /// What to do to each file's length at open.
    pub sizing: G3Sizing,
}

impl G3Tuning {
    fn worker_count(&self, files: usize) -> usize {
        match self.workers {
            0 => files.saturating_mul(2).clamp(2, 16),
            n => n.min(MAX_WORKERS),
        }
    }
}

/// One slot's transfer between caller memory and the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct G3Io {
    /// The slot (`0..store.slots()`).
    pub slot: u64,
    /// The direction.
    pub op: G3Op,
    /// The caller memory's first byte (aligned to [`G3Store::alignment`]).
    pub addr: u64,
    /// The caller memory's length: exactly [`G3Store::slot_bytes`].
    pub len: u64,
}

impl G3Io {
    /// Slot → memory.
    pub fn read(slot: u64, addr: u64, len: u64) -> Self {
        Self {
            slot,
            op: G3Op::Read,
            addr,
            len,
        }
    }

    /// Memory → slot.
    pub fn write(slot: u64, addr: u64, len: u64) -> Self {
        Self {
            slot,
            op: G3Op::Write,
            addr,
            len,
        }
    }
}

/// One slot's transfer to or from a borrowed buffer
/// ([`G3Store::run_batch_slices`]).
#[derive(Debug)]
pub enum G3SliceIo<'a> {
    /// Slot → `dst`.
    Read {
        /// The slot.
        slot: u64,
        /// One slot's bytes, aligned.
        dst: &'a mut [u8],
    },
    /// `src` → slot.
    Write {
        /// The slot.
        slot: u64,
        /// One slot's bytes, aligned.
        src: &'a [u8],
    },
}

/// One open, locked file of the store.
#[derive(Debug)]
struct G3File {
    /// As configured (named in errors).
    path: PathBuf,
    /// Its directory resolved, its own name as given (compared for
    /// duplicates, re-`stat`ed by `check`).
    canonical: PathBuf,
    dev: u64,
    ino: u64,
    /// Open `O_DIRECT`, locked; closing it releases the lock.
    file: File,
}

/// What the workers share with the store.
#[derive(Debug)]
struct Files {
    files: Vec<G3File>,
    slot_bytes: u64,
    slots: u64,
    /// Memory alignment the caller's buffers need (the largest of the files').
    mem_align: u64,
    /// File offset alignment (the largest of the files'); divides the slot
    /// size.
    offset_align: u64,
}

impl Files {
    /// The file and byte offset of `slot`.
    fn locate(&self, slot: u64) -> Option<(&G3File, u64)> {
        if slot >= self.slots {
            return None;
        }
        let n = self.files.len() as u64;
        let file = self.files.get(usize::try_from(slot % n).ok()?)?;
        Some((file, (slot / n) * self.slot_bytes))
    }

    /// Checks an item's slot, length and alignment; its file and offset.
    fn validate(&self, item: &G3Io) -> Result<(&G3File, u64), G3Error> {
        let (file, offset) = self.locate(item.slot).ok_or(G3Error::SlotRange {
            slot: item.slot,
            slots: self.slots,
        })?;
        if item.len != self.slot_bytes
            || !item.addr.is_multiple_of(self.mem_align)
            || item.addr == 0
            || item.addr.checked_add(item.len).is_none()
        {
            return Err(G3Error::Buffer {
                slot: item.slot,
                addr: item.addr,
                len: item.len,
                slot_bytes: self.slot_bytes,
                align: self.mem_align,
            });
        }
        Ok((file, offset))
    }

    /// The typed error for a failed transfer.
    fn failure(&self, file: &G3File, item: &G3Io, failure: direct_io::Failure) -> G3Error {
        let errno = match failure {
            direct_io::Failure::Short(done) => {
                return G3Error::ShortIo {
                    path: file.path.clone(),
                    slot: item.slot,
                    op: item.op,
                    done,
                    len: item.len,
                };
            }
            direct_io::Failure::Errno(errno) => errno,
        };
        if file.file.metadata().is_ok_and(|m| m.nlink() == 0) {
            return G3Error::FileGone {
                path: file.path.clone(),
                how: G3Gone::Unlinked,
                slot: Some(item.slot),
                errno: Some(errno),
            };
        }
        match (item.op, errno) {
            (G3Op::Write, libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => G3Error::NoSpace {
                path: file.path.clone(),
                slot: item.slot,
                errno,
            },
            (op, errno) => G3Error::Io {
                path: file.path.clone(),
                slot: item.slot,
                op,
                errno,
            },
        }
    }
}

/// The G3 file tier: locked `O_DIRECT` files, slots striped across them, and
/// worker threads that move many slots at once.
///
/// `Send + Sync`: every method takes `&self`, so the runner's threads share
/// one store without a lock of their own.
pub struct G3Store {
    // Field order is load-bearing: the workers are joined (after finishing
    // every queued item and callback) before the files close, so no I/O can
    // reach a closed or reused descriptor and the locks outlive the I/O.
    pool: WorkerPool,
    files: Arc<Files>,
    /// The memory items named by address may touch.
    memory: Arc<kvcr_sys::MemoryRegistry>,
}

impl std::fmt::Debug for G3Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("G3Store")
            .field("paths", &self.paths().collect::<Vec<_>>())
            .field("slot_bytes", &self.files.slot_bytes)
            .field("slots", &self.files.slots)
            .field("workers", &self.pool.threads())
            .finish()
    }
}

impl G3Store {
    /// Opens the tier with default tuning ([`G3Tuning::default`]); see the
    /// module docs for every refusal.
    pub fn open(options: &G3Options, slot_bytes: u64) -> Result<Self, G3Error> {
        Self::open_with(options, slot_bytes, G3Tuning::default())
    }

    /// Opens the tier: resolves, checks, opens and locks every file, then
    /// starts the workers. All or nothing.
    pub fn open_with(
        options: &G3Options,
        slot_bytes: u64,
        tuning: G3Tuning,
    ) -> Result<Self, G3Error> {
        let config = |why| Err(G3Error::Config { why });
        let capacity = options.capacity_bytes_per_file;
        if options.paths.is_empty() {
            return config("at least one path is required");
        }
        if options.paths.len() > MAX_FILES {
            return config("too many paths (at most 4096)");
        }
        if slot_bytes == 0 {
            return config("the slot size must be positive");
        }
        if capacity == 0 {
            return config("the capacity per file must be positive");
        }
        if !capacity.is_multiple_of(slot_bytes) {
            return config("the capacity per file must be a multiple of the slot size");
        }
        if i64::try_from(capacity).is_err() || usize::try_from(slot_bytes).is_err() {
            return config("the capacity per file exceeds the largest file offset");
        }
        let slots = (capacity / slot_bytes)
            .checked_mul(options.paths.len() as u64)
            .ok_or(G3Error::Config {
                why: "the slot count overflows",
            })?;

        let mut files: Vec<G3File> = Vec::with_capacity(options.paths.len());
        let (mut mem_align, mut offset_align) = (1u64, 1u64);
        for path in &options.paths {
            let located = open::locate(path)?;
            if let Some(first) = files.iter().find(|f| f.canonical == located.canonical) {
                return Err(G3Error::Duplicate {
                    path: path.clone(),
                    same_as: first.path.clone(),
                });
            }
            let (file, (mem, offset)) = open::open_one(path, &located, &files)?;
            if !slot_bytes.is_multiple_of(offset) {
                return Err(G3Error::Alignment {
                    path: path.clone(),
                    slot_bytes,
                    align: offset,
                });
            }
            if tuning.sizing == G3Sizing::Sparse {
                let len = file
                    .file
                    .metadata()
                    .map_err(|e| path_error(path, "cannot be examined", e.raw_os_error()))?
                    .len();
                if len < capacity {
                    file.file
                        .set_len(capacity)
                        .map_err(|e| path_error(path, "cannot be extended", e.raw_os_error()))?;
                }
            }
            mem_align = mem_align.max(mem);
            offset_align = offset_align.max(offset);
            files.push(file);
        }
        let files = Arc::new(Files {
            files,
            slot_bytes,
            slots,
            mem_align,
            offset_align,
        });
        let pool = WorkerPool::start(tuning.worker_count(options.paths.len()))?;
        Ok(Self {
            pool,
            files,
            memory: Arc::new(kvcr_sys::MemoryRegistry::new()),
        })
    }

    /// Number of slots: files × (capacity per file / slot size).
    pub fn slots(&self) -> u64 {
        self.files.slots
    }

    /// The memory the address-named entry points ([`G3Store::run_batch`],
    /// [`G3Store::submit`], [`G3Store::read_slot`], [`G3Store::write_slot`])
    /// may touch: register buffers here first (a store opened on its own
    /// starts with none; the runner's shares the runner's pools and regions).
    pub fn memory(&self) -> &Arc<kvcr_sys::MemoryRegistry> {
        &self.memory
    }

    /// Moves items through `memory` instead (the runner's registry).
    pub(crate) fn use_memory(&mut self, memory: Arc<kvcr_sys::MemoryRegistry>) {
        self.memory = memory;
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        self.files.slot_bytes
    }

    /// The memory alignment a caller's buffers need (the largest direct-I/O
    /// memory alignment of the files).
    pub fn alignment(&self) -> u64 {
        self.files.mem_align
    }

    /// The file offset alignment the slot size is a multiple of (the largest
    /// direct-I/O offset alignment of the files).
    pub fn offset_alignment(&self) -> u64 {
        self.files.offset_align
    }

    /// Number of files.
    pub fn file_count(&self) -> usize {
        self.files.files.len()
    }

    /// The files' paths, as configured, in stripe order.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.files.iter().map(|f| f.path.as_path())
    }

    /// Where `slot` lives: (file index, byte offset), or `None` past the
    /// end. Slot `i` is in file `i % n` at `(i / n) * slot_bytes`.
    pub fn location(&self, slot: u64) -> Option<(usize, u64)> {
        let (_, offset) = self.files.locate(slot)?;
        let n = self.files.files.len() as u64;
        Some((usize::try_from(slot % n).ok()?, offset))
    }

    /// Number of worker threads.
    pub fn workers(&self) -> usize {
        self.pool.threads()
    }

    /// Callbacks of [`G3Store::submit`] that panicked (each was caught).
    pub fn callback_panics(&self) -> u64 {
        self.pool.callback_panics()
    }

    /// Checks that every configured path still leads to the store's file:
    /// `fstat` (`st_nlink == 0`: [`G3Gone::Unlinked`]) and `stat` of the
    /// path (another inode, or none: [`G3Gone::PathElsewhere`]). The first
    /// file that fails, as [`G3Error::FileGone`]. No I/O of slots.
    pub fn check(&self) -> Result<(), G3Error> {
        for f in &self.files.files {
            let meta = f
                .file
                .metadata()
                .map_err(|e| path_error(&f.path, "cannot be examined", e.raw_os_error()))?;
            let gone = |how| G3Error::FileGone {
                path: f.path.clone(),
                how,
                slot: None,
                errno: None,
            };
            if meta.nlink() == 0 {
                return Err(gone(G3Gone::Unlinked));
            }
            match std::fs::symlink_metadata(&f.canonical) {
                Ok(now) if now.dev() == f.dev && now.ino() == f.ino => {}
                _ => return Err(gone(G3Gone::PathElsewhere)),
            }
        }
        Ok(())
    }

    /// `fdatasync` on every file: not needed for a slot to be readable
    /// after its write returned (see the module docs); for a caller that
    /// wants the bytes to survive a power loss. The first failure.
    pub fn sync_data(&self) -> Result<(), G3Error> {
        for f in &self.files.files {
            f.file
                .sync_data()
                .map_err(|e| path_error(&f.path, "fdatasync failed", e.raw_os_error()))?;
        }
        Ok(())
    }
}
