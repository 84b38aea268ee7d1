//! Unsafe, named: the G3 tier's system calls and its raw-memory I/O.
//!
//! Everything that turns an address into a memory access, or asks the
//! kernel something through `libc`, is here: `flock`, `statx`
//! (`STATX_DIOALIGN`), the `pread`/`pwrite` loops that move one slot between
//! caller memory and its file, the store's `unsafe` I/O entry points (whose
//! callers promise the memory), the safe slice wrappers over them, and
//! [`DirectBuf`], an owned aligned buffer.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fs::File;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::Arc;

use super::pool::{Exec, Outcome};
use super::{Files, G3Io, G3Op, G3SliceIo, G3Store};

/// The calling thread's `errno` after a failed call.
fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Takes `flock(LOCK_EX | LOCK_NB)` on `file`'s open file description.
/// `Ok(false)`: someone else holds a lock on the file. The lock goes with the
/// descriptor: closing the file releases it (and `O_CLOEXEC` keeps it out of
/// child processes).
pub(super) fn lock_exclusive(file: &File) -> Result<bool, i32> {
    loop {
        // SAFETY: `flock` on a descriptor `file` owns and keeps open for
        // the call; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        match last_errno() {
            libc::EINTR => continue,
            libc::EWOULDBLOCK => return Ok(false),
            errno => return Err(errno),
        }
    }
}

/// The file's direct-I/O alignment from `statx(STATX_DIOALIGN)`:
/// `Some((memory, offset))` when the kernel reports it (both 0: the file does
/// not support direct I/O), `None` when it does not (older kernels, some
/// filesystems).
pub(super) fn dio_alignment(file: &File) -> Result<Option<(u32, u32)>, i32> {
    // SAFETY: `statx` is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: an empty C string with `AT_EMPTY_PATH` names the descriptor
    // itself, which `file` keeps open; `stx` is a valid, writable `statx`
    // that the kernel fills.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 {
        return Err(last_errno());
    }
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(None);
    }
    Ok(Some((stx.stx_dio_mem_align, stx.stx_dio_offset_align)))
}

/// Why a slot's transfer stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failure {
    /// A call failed with this `errno`.
    Errno(i32),
    /// The kernel moved these bytes, then none (end of file).
    Short(u64),
}

/// Reads or writes `len` bytes at `addr` from or to `offset` of `file`,
/// continuing after partial transfers and `EINTR`.
///
/// # Safety
/// 1. For a read, `addr..addr+len` is valid for writes; for a write, valid
///    for reads; for the whole call.
/// 2. Nobody else accesses the range during the call (for a write: nobody
///    writes it).
unsafe fn transfer(file: &File, op: G3Op, addr: u64, len: u64, offset: u64) -> Result<(), Failure> {
    let fd = file.as_raw_fd();
    let mut done = 0u64;
    while done < len {
        let ptr = (addr + done) as usize as *mut libc::c_void;
        // Linux moves at most 0x7fff_f000 bytes a call: a page multiple, so
        // the rest stays aligned; the loop does the remainder.
        let count = usize::try_from(len - done).unwrap_or(usize::MAX);
        let Ok(at) = libc::off_t::try_from(offset + done) else {
            return Err(Failure::Errno(libc::EOVERFLOW));
        };
        let rc = match op {
            // SAFETY: `ptr..ptr+count` is the untransferred tail of the
            // caller's range: writable and not otherwise accessed (this
            // function's contract); `fd` is open (borrowed `file`).
            G3Op::Read => unsafe { libc::pread(fd, ptr, count, at) },
            // SAFETY: as above, readable and not written by anyone else.
            G3Op::Write => unsafe { libc::pwrite(fd, ptr, count, at) },
        };
        match rc {
            rc if rc > 0 => done += rc.unsigned_abs() as u64,
            0 => return Err(Failure::Short(done)),
            _ => match last_errno() {
                libc::EINTR => {}
                errno => return Err(Failure::Errno(errno)),
            },
        }
    }
    Ok(())
}

/// Validates one item and moves its slot.
///
/// # Safety
/// The item's memory as [`G3Store::run_batch`] requires, for the call.
unsafe fn execute(files: &Files, item: &G3Io) -> Outcome {
    let (file, offset) = files.validate(item)?;
    // SAFETY: `validate` checked the length (one slot) and the alignment;
    // the memory itself is this function's contract.
    let result = unsafe { transfer(&file.file, item.op, item.addr, item.len, offset) };
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

/// An owned, zeroed, pre-faulted buffer aligned for direct I/O (for tests,
/// benchmarks and bounce buffers; the runner's pools are page-aligned
/// already).
pub struct DirectBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a DirectBuf uniquely owns its allocation (like a `Box<[u8]>`);
// moving it moves plain bytes.
unsafe impl Send for DirectBuf {}
// SAFETY: shared access gives only `&[u8]` (through `Deref`); writes need
// `&mut self`.
unsafe impl Sync for DirectBuf {}

impl DirectBuf {
    /// `len` zeroed bytes aligned to `align` (a power of two), every page
    /// touched once. `None` when `len` is 0, `align` is not a power of two,
    /// or the allocation fails.
    pub fn new(len: usize, align: usize) -> Option<Self> {
        if len == 0 {
            return None;
        }
        let layout = Layout::from_size_align(len, align).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        let mut buf = Self { ptr, layout };
        // Fault every page in now (a large zeroed allocation is fresh,
        // untouched mappings): the first I/O then runs at full speed.
        for page in buf.chunks_mut(4096) {
            if let Some(b) = page.first_mut() {
                // SAFETY: `b` is a valid, exclusive reference into the buffer.
                unsafe { std::ptr::write_volatile(b, 0) };
            }
        }
        Some(buf)
    }

    /// The first byte's address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }
}

impl Deref for DirectBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` owns `layout.size()` initialised (zeroed) bytes for
        // as long as `self` lives; shared access through `&self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl DerefMut for DirectBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `deref`, exclusive through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for DirectBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed
        // once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl std::fmt::Debug for DirectBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectBuf")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.layout.size())
            .field("align", &self.layout.align())
            .finish()
    }
}

/// Test support: limits the size of files this process writes
/// (`RLIMIT_FSIZE`) and ignores `SIGXFSZ`, so a write past the limit fails
/// with `EFBIG` instead of killing the process. Process-wide: call it only
/// in a child process of its own.
#[cfg(test)]
pub(super) fn limit_file_size(bytes: u64) -> Result<(), i32> {
    // SAFETY: setting a signal's disposition to "ignore" runs no handler
    // code; `SIG_IGN` is a valid disposition for `SIGXFSZ`.
    if unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) } == libc::SIG_ERR {
        return Err(last_errno());
    }
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: `limit` is a valid `rlimit` that outlives the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &limit) } != 0 {
        return Err(last_errno());
    }
    Ok(())
}
