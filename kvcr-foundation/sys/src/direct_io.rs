//! Direct I/O: the system calls of the file tier (`openat` of one name in
//! an open directory, `flock`, `statx` for `STATX_DIOALIGN`), the
//! `pread`/`pwrite` loop that moves one slot between memory and its file,
//! and [`DirectBuf`], an owned aligned buffer.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::ptr::NonNull;

/// Which way a slot moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// File to memory (`pread`).
    Read,
    /// Memory to file (`pwrite`).
    Write,
}

/// The calling thread's `errno` after a failed call.
pub fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Opens `name`, one entry of the open directory `dir`, read-write:
/// `openat(dir, name, O_RDWR | O_CLOEXEC | O_NOFOLLOW | extra_flags)`, and
/// with `create_mode` also `O_CREAT | O_EXCL` (mode `create_mode`, less the
/// umask), so the call either makes a new file or fails with `EEXIST`.
///
/// The name is looked up in `dir` itself (not by a path that could be
/// re-pointed between a check and the open), and a symlink there is never
/// followed (`ELOOP`). A name that is empty, `.`, `..`, or holds a `/` or a
/// NUL is refused (`InvalidInput`) without a call.
pub fn open_in_dir(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    extra_flags: libc::c_int,
    create_mode: Option<u32>,
) -> io::Result<File> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a single file name",
        ));
    }
    let name = CString::new(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the name"))?;
    let mut flags = libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW | extra_flags;
    let mode = match create_mode {
        Some(mode) => {
            flags |= libc::O_CREAT | libc::O_EXCL;
            mode
        }
        None => 0,
    };
    loop {
        // SAFETY: `dir` is an open descriptor borrowed for the call; `name`
        // is a NUL-terminated string alive for the call; the mode is passed
        // by value (read only with O_CREAT).
        let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, mode) };
        if fd >= 0 {
            // SAFETY: the kernel just installed `fd` for this call alone;
            // nothing else owns it.
            return Ok(unsafe { File::from_raw_fd(fd) });
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Takes `flock(LOCK_EX | LOCK_NB)` on `file`'s open file description.
/// `Ok(false)`: someone else holds a lock on the file. The lock goes with the
/// descriptor: closing the file releases it (and `O_CLOEXEC` keeps it out of
/// child processes).
pub fn lock_exclusive(file: &File) -> Result<bool, i32> {
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
pub fn dio_alignment(file: &File) -> Result<Option<(u32, u32)>, i32> {
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
pub enum Failure {
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
pub unsafe fn transfer(
    file: &File,
    op: Transfer,
    addr: u64,
    len: u64,
    offset: u64,
) -> Result<(), Failure> {
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
            Transfer::Read => unsafe { libc::pread(fd, ptr, count, at) },
            // SAFETY: as above, readable and not written by anyone else.
            Transfer::Write => unsafe { libc::pwrite(fd, ptr, count, at) },
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

/// [`transfer`] into a borrowed buffer: `dst.len()` bytes from `offset`.
pub fn read_into(file: &File, dst: &mut [u8], offset: u64) -> Result<(), Failure> {
    let (addr, len) = (dst.as_mut_ptr() as usize as u64, dst.len() as u64);
    // SAFETY: `dst` is borrowed exclusively for the call: writable, and
    // nobody else accesses it.
    unsafe { transfer(file, Transfer::Read, addr, len, offset) }
}

/// [`transfer`] from a borrowed buffer: `src.len()` bytes to `offset`.
pub fn write_from(file: &File, src: &[u8], offset: u64) -> Result<(), Failure> {
    let (addr, len) = (src.as_ptr() as usize as u64, src.len() as u64);
    // SAFETY: `src` is borrowed for the call: readable, and nobody writes
    // it meanwhile.
    unsafe { transfer(file, Transfer::Write, addr, len, offset) }
}

impl crate::copy::MemoryRegistry {
    /// [`transfer`] of registered memory: `Err` (nothing moved) when
    /// `addr..addr + len` is not registered, or, for a read into it, not
    /// writable; else the transfer's own outcome. The range stays
    /// registered until the transfer returns (the read lock is held).
    pub fn transfer(
        &self,
        file: &File,
        op: Transfer,
        addr: u64,
        len: u64,
        offset: u64,
    ) -> crate::Result<Result<(), Failure>> {
        let ranges = self.read_lock();
        let registered = match op {
            Transfer::Read => crate::copy::holds_writable(&ranges, addr, len),
            Transfer::Write => crate::copy::holds(&ranges, addr, len),
        };
        if !registered {
            return Err(crate::SysError::Unregistered { addr, len });
        }
        // SAFETY: the range is registered (checked under the read lock,
        // held until the transfer returns, so it is not removed meanwhile):
        // valid by `insert`'s promise, owned, or lent; a read's range is
        // writable. Who else touches it when is the caller's protocol, as
        // for every copy through the registry.
        let moved = unsafe { transfer(file, op, addr, len, offset) };
        drop(ranges);
        Ok(moved)
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
#[doc(hidden)]
pub fn limit_file_size(bytes: u64) -> Result<(), i32> {
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
