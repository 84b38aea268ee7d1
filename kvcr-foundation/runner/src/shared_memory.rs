//! Unsafe, named: same-host one-copy writes between runners.
//!
//! In peer mode each pool is a sealed `memfd` mapped shared ([`SharedPool`]).
//! A target advertises the file (its pid and fd, a random name token) with
//! its metadata; a source on the same host and in the same pid namespace
//! opens `/proc/<pid>/fd/<fd>`, checks the file ([`PeerSegment::open`]) and
//! maps it, and then writes pages with one `memcpy` per span on its lanes
//! ([`crate::lanes`]) — no UCX, no second copy through shared-memory FIFOs,
//! and nothing needed from the target while the bytes land.
//!
//! What the source checks before it maps anything a target named:
//! * the host (kernel boot id) and pid namespace are its own;
//! * the file opened is a memfd named `kvcr-pool-<token>` with the
//!   advertised token (checked on the opened descriptor, not the path);
//! * the file is sealed against shrinking, so it can never become shorter
//!   than the mapping (no `SIGBUS` on a write), and fully allocated, so no
//!   write of ours allocates memory on the target's behalf (a sparse file
//!   could make us commit memory without bound);
//! * every write stays inside the mapping (bounds-checked per span).
//!
//! The kernel's own rule covers the rest: opening another process's
//! descriptor through `/proc` needs the access `ptrace` read mode needs
//! (same user, dumpable), the access a same-host peer already has to write
//! that process's memory.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvcr_contracts::protocol::{SegmentAdvert, SharedMemoryAdvert};
use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Error, PoolMemoryReason, Result, RunnerReason};

/// Prefix of a pool file's name (`memfd:` names show in `/proc/*/fd`).
const NAME_PREFIX: &str = "kvcr-pool-";

/// Where this process runs: the kernel boot and the pid namespace. Two
/// processes with equal scopes can reach each other's descriptors through
/// `/proc/<pid>/fd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HostScope {
    pub(crate) boot_id: [u8; 16],
    pub(crate) pid_namespace: u64,
}

impl HostScope {
    /// This process's scope; `None` when `/proc` does not tell.
    pub(crate) fn current() -> Option<Self> {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let boot_id = parse_uuid(text.trim())?;
        let pid_namespace = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
        Some(Self {
            boot_id,
            pid_namespace,
        })
    }

    /// Whether a target advertising `advert` runs in this scope.
    pub(crate) fn matches(&self, advert: &SharedMemoryAdvert) -> bool {
        self.boot_id == advert.boot_id && self.pid_namespace == advert.pid_namespace
    }
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` to its 16 bytes.
fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let hex: String = text.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn hex(token: &[u8; 16]) -> String {
    token.iter().map(|b| format!("{b:02x}")).collect()
}

fn os_error(call: &'static str) -> Error {
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    Error::runner(RunnerReason::PoolMemory(PoolMemoryReason::Os {
        call,
        errno,
    }))
}

/// A pool backed by a sealed memfd, mapped shared. Owned by the UCX
/// registration (which unmaps it from UCX before dropping it); the file
/// stays open for the pool's life so same-host sources can reach it.
///
/// Field order is drop order: the mapping goes before the file.
#[derive(Debug)]
pub(crate) struct SharedPool {
    map: MmapRaw,
    file: File,
    token: [u8; 16],
}

impl SharedPool {
    /// A zeroed pool of `len` bytes (a multiple of the page size is not
    /// required); with `prefault`, every page is touched now, so neither
    /// this process nor a peer's first write pays the fault.
    pub(crate) fn create(len: u64, prefault: bool) -> Result<Self> {
        let (file, token) = create_pool_file(len)?;
        Self::map(file, token, len, prefault)
    }

    /// A pool in a file made by [`create_pool_file`] in this or another
    /// process (a guard hands one over): its name must carry `token`, its
    /// size be `len` and its seals be in place, checked on the descriptor.
    /// Its bytes are kept: with `prefault` the pages are populated without
    /// being written (a recovered pool holds pages).
    pub(crate) fn adopt(file: File, token: [u8; 16], len: u64, prefault: bool) -> Result<Self> {
        check_pool_file(&file, &token, len)?;
        let pool = Self::map(file, token, len, false)?;
        if prefault {
            // SAFETY: the range is exactly our live mapping.
            unsafe { populate_for_write(pool.map.as_mut_ptr() as u64, pool.map.len() as u64) };
        }
        Ok(pool)
    }

    fn map(file: File, token: [u8; 16], len: u64, prefault: bool) -> Result<Self> {
        let size = usize::try_from(len)
            .map_err(|_| Error::runner(RunnerReason::Allocation { bytes: len }))?;
        let map = MmapOptions::new()
            .len(size)
            .map_raw(&file)
            .map_err(|_| os_error("mmap"))?;
        // A file of huge pages is mapped with one entry per 2 MiB here too.
        advise_huge_pages(&map);
        let pool = Self { map, file, token };
        if prefault {
            pool.prefault();
        }
        Ok(pool)
    }

    fn prefault(&self) {
        let page = 4096;
        let mut offset = 0;
        while offset < self.map.len() {
            // SAFETY: `offset < len`, inside our mapping, which nothing else
            // references yet (not advertised, not registered). Writing the
            // zero already there faults the page in without changing data.
            unsafe { self.map.as_mut_ptr().add(offset).write_volatile(0) };
            offset += page;
        }
    }

    /// How a source reaches this pool as region `region`.
    pub(crate) fn advert(&self, region: kvcr_contracts::protocol::RegionId) -> SegmentAdvert {
        SegmentAdvert {
            region,
            fd: u32::try_from(self.file.as_raw_fd()).unwrap_or(u32::MAX),
            token: self.token,
        }
    }
}

// SAFETY: `map` is a live shared mapping of `map.len()` writable bytes, owned
// by this value and unmapped only when it is dropped.
unsafe impl kvcr_ucx::OwnedMemory for SharedPool {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    fn byte_len(&self) -> usize {
        self.map.len()
    }
}

/// Makes a pool's file: a memfd named `kvcr-pool-<token>` of `len` bytes,
/// every page allocated, sealed against shrinking and growing. A runner maps
/// it ([`SharedPool`]); a guard makes them for the runners it serves.
///
/// Where the host lets shared memory have transparent huge pages
/// ([`crate::placement::shared_memory_huge_pages`]), a pool of 2 MiB or more
/// is allocated as huge pages. In `advise` mode (the one that does not give
/// every shared-memory file huge pages) only a faulting mapping that asked
/// (`MADV_HUGEPAGE`) gets them, and `fallocate` has no mapping to ask with,
/// so the pages are allocated through such a mapping first; the
/// `fallocate` after it allocates whatever is left. A huge page is one
/// page-table entry for 2 MiB in every process that maps the pool: on the
/// 2-vCPU VM with `shmem_enabled` set to `advise`, a source's mapping of a
/// 1 GiB pool populated in 0.7–0.9 ms against 75–90 ms, and making the pool
/// took 77 ms against 780–940 ms (3.3–3.5 s on the first try after 4 KiB
/// pages had fragmented the memory: the kernel compacts to find 2 MiB
/// pages; `defrag` decides how hard).
/// Elsewhere (`never`, the default on the hosts measured) nothing changes.
pub(crate) fn create_pool_file(len: u64) -> Result<(File, [u8; 16])> {
    let huge = len >= HUGE_PAGE && crate::placement::shared_memory_huge_pages();
    create_sealed_file(NAME_PREFIX, len, huge)
}

/// The transparent-huge-page size, as a file length.
const HUGE_PAGE: u64 = crate::placement::HUGE_PAGE as u64;

/// Makes a residency journal's file: a memfd like a pool's, named
/// `kvcr-journal-<token>` (never taken for a pool: a source checks the name).
pub(crate) fn create_journal_file(len: u64) -> Result<File> {
    create_sealed_file("kvcr-journal-", len, false).map(|(file, _)| file)
}

fn create_sealed_file(prefix: &str, len: u64, huge: bool) -> Result<(File, [u8; 16])> {
    let failed = || Error::runner(RunnerReason::Allocation { bytes: len });
    if len == 0 || usize::try_from(len).is_err() {
        return Err(failed());
    }
    let mut token = [0u8; 16];
    getrandom::fill(&mut token).map_err(|_| failed())?;
    let name = CString::new(format!("{prefix}{}", hex(&token))).map_err(|_| failed())?;
    // SAFETY: `name` is a valid NUL-terminated string; the flags are
    // plain bits. The returned descriptor is owned by the `File` below.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(os_error("memfd_create"));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by
    // nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len).map_err(|_| os_error("ftruncate"))?;
    if huge {
        allocate_huge_pages(&file, len);
    }
    // Every page allocated now, by us: a source checks this, so its
    // writes never allocate memory on our behalf.
    // SAFETY: fallocate on our own memfd, within its size; no memory is
    // passed.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) } != 0 {
        return Err(os_error("fallocate"));
    }
    // The size is final: a source maps a region of the file, and a
    // shrink would turn its writes into SIGBUS.
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on our own memfd; no memory is passed.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(os_error("fcntl(F_ADD_SEALS)"));
    }
    Ok((file, token))
}

/// Allocates `file`'s `len` bytes through a temporary shared mapping that
/// asks for transparent huge pages, so each 2 MiB the kernel can find whole
/// is one huge page (see [`create_pool_file`]). Best effort: whatever this
/// leaves unallocated, the caller's `fallocate` allocates as 4 KiB pages.
fn allocate_huge_pages(file: &File, len: u64) {
    let Ok(size) = usize::try_from(len) else {
        return;
    };
    let Ok(map) = MmapOptions::new().len(size).map_raw(file) else {
        return;
    };
    if map.advise(memmap2::Advice::HugePage).is_err() {
        return;
    }
    // SAFETY: the range is exactly `map`, a live shared mapping of our own
    // new memfd that nothing else has seen; populating allocates its pages
    // (zeroed, as the file's bytes already are) and changes no byte.
    let _ = unsafe { libc::madvise(map.as_mut_ptr().cast(), size, libc::MADV_POPULATE_WRITE) };
}

/// The residency journal's file (a guard's memfd), mapped shared: the runner
/// writes it through `kvcr_runner_core::journal`, the guard and a restarted runner
/// read it after this process is gone.
#[derive(Debug)]
pub(crate) struct JournalMap {
    map: memmap2::MmapMut,
}

impl JournalMap {
    /// Maps all of `file` (at least `min_len` bytes, sealed against
    /// shrinking: a mapping of a file that shrinks faults).
    pub(crate) fn new(file: &File, min_len: u64) -> Result<Self> {
        let bad = |why| {
            Error::runner(RunnerReason::Config {
                field: "guard grant",
                why,
            })
        };
        let len = file.metadata().map_err(|_| os_error("fstat"))?.len();
        if len < min_len || usize::try_from(len).is_err() {
            return Err(bad("the journal file is shorter than asked"));
        }
        // SAFETY: F_GET_SEALS on a descriptor we own; no memory is passed.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(bad("the journal file is not sealed against shrinking"));
        }
        // SAFETY: the file cannot shrink under the mapping (sealed, checked
        // above); the only other holder is the guard, which reads it only
        // once this process's lease has ended (its death or release), so no
        // one else writes these bytes while we hold `&mut` to them.
        let map =
            unsafe { memmap2::MmapOptions::new().map_mut(file) }.map_err(|_| os_error("mmap"))?;
        Ok(Self { map })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// Checks an opened pool file on its descriptor: a memfd named for `token`
/// (the name of what was opened, not of a path that may have changed), at
/// least `extent` bytes long and allocated, sealed against shrinking.
fn inspect_pool_file(
    file: &File,
    token: &[u8; 16],
    extent: u64,
) -> std::result::Result<(), SegmentRefusal> {
    let expected = format!("/memfd:{NAME_PREFIX}{} (deleted)", hex(token));
    let name = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|_| SegmentRefusal::Name)?;
    if name.as_os_str() != expected.as_str() {
        return Err(SegmentRefusal::Name);
    }
    let meta = file.metadata().map_err(|_| SegmentRefusal::Size)?;
    let allocated = meta.blocks().saturating_mul(512);
    if !meta.is_file() || extent == 0 || meta.len() < extent || allocated < extent {
        return Err(SegmentRefusal::Size);
    }
    // SAFETY: F_GET_SEALS on a descriptor we own; no memory is passed.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(SegmentRefusal::Seals);
    }
    Ok(())
}

/// [`inspect_pool_file`] for a pool handed to this runner: exactly `len`
/// bytes.
fn check_pool_file(file: &File, token: &[u8; 16], len: u64) -> Result<()> {
    let exact = file.metadata().is_ok_and(|m| m.len() == len);
    match inspect_pool_file(file, token, len) {
        Ok(()) if exact => Ok(()),
        Ok(()) => Err(Error::runner(RunnerReason::Config {
            field: "guard grant",
            why: "a granted pool file is not the pool's size",
        })),
        Err(refusal) => Err(Error::runner(RunnerReason::Config {
            field: "guard grant",
            why: refusal.why(),
        })),
    }
}

/// Asks for huge-page mappings of a pool file (`MADV_HUGEPAGE`), when the
/// host allows shared memory to have them and the mapping spans one. Best
/// effort: without them the mapping works with 4 KiB pages.
fn advise_huge_pages(map: &MmapRaw) {
    if map.len() as u64 >= HUGE_PAGE && crate::placement::shared_memory_huge_pages() {
        let _ = map.advise(memmap2::Advice::HugePage);
    }
}

/// Makes this process's page-table entries for `addr..addr+len` of a
/// shared mapping of a pool file, so the copy that follows takes no fault
/// per 4 KiB page: a first write into a mapped peer pool ran at 2.8 GB/s
/// faulting, against 13 GB/s once populated. Populating is batched per call
/// (no exception per page) and changes no byte. Best effort: kernels before
/// 5.14 refuse it and the copy faults as usual.
///
/// It populates with read faults (`MADV_POPULATE_READ`), not write faults:
/// a read fault on a file mapping maps its neighbours too (the kernel's
/// fault-around, 16 pages), and a pool file is shared memory, which tracks
/// no dirty pages, so the entries a shared writable mapping gets from a
/// read are writable already and the copy after it takes no fault either.
/// A write fault maps one page at a time. One GiB of a prefaulted memfd:
/// 61–79 ms populating by reads against 170–173 by writes on the 2-vCPU
/// VM, 34–45 against 87–125 on the H200 host, the copy after either as
/// fast as into a mapping populated long before. The TP=2 peer hop there
/// (8 GB per rank into fresh mappings, both ranks at once, three
/// alternating runs) went from 12.7–14.7 GB/s per rank with write faults
/// (`MADV_POPULATE_WRITE`, before 2026-12-03) to 15.7–19.8. Were the
/// entries read-only on some kernel, each first write would take a cheap
/// write-protect fault and nothing else changes.
///
/// # Safety
/// `addr..addr+len` must lie inside one live shared mapping of this
/// process that stays mapped for the call.
pub(crate) unsafe fn populate_for_write(addr: u64, len: u64) {
    const PAGE: u64 = 4096;
    let start = addr & !(PAGE - 1);
    let end = addr.saturating_add(len).div_ceil(PAGE) * PAGE;
    // SAFETY: the caller's contract; the range is widened to whole pages,
    // which lie in the same mapping (mappings are whole pages).
    let _ = unsafe {
        libc::madvise(
            start as usize as *mut libc::c_void,
            (end - start) as usize,
            libc::MADV_POPULATE_READ,
        )
    };
}

/// Reads `out.len()` bytes at `offset` of `region`, which another process
/// may be writing at the same moment (a doorbell's slots): volatile byte
/// loads, no reference into the memory, then an acquire fence (whatever the
/// writer published before these bytes is visible after). `false`, reading
/// nothing, when the range is not inside `region`.
pub(crate) fn read_shared(
    region: &kvcr_ucx::Registration<'_>,
    offset: usize,
    out: &mut [u8],
) -> bool {
    if offset
        .checked_add(out.len())
        .is_none_or(|end| end > region.len())
    {
        return false;
    }
    // SAFETY: `offset..offset + out.len()` lies inside the registration's
    // live memory (checked above), which outlives this borrow.
    unsafe { load_shared_bytes(region.as_ptr().add(offset), out) };
    true
}

/// Copies `out.len()` bytes from `src`, which another process may be
/// writing at the same moment: volatile byte loads (no reference into the
/// memory is formed, and a concurrent writer leaves at worst a torn copy,
/// which fails its tag and is read again next turn), then an acquire fence
/// (whatever the writer published before these bytes is visible after).
///
/// # Safety
/// `src..src + out.len()` is mapped, readable memory that stays mapped for
/// the call.
unsafe fn load_shared_bytes(src: *const u8, out: &mut [u8]) {
    for (i, byte) in out.iter_mut().enumerate() {
        // SAFETY: `src + i` lies inside the range the caller vouches for.
        *byte = unsafe { src.add(i).read_volatile() };
    }
    std::sync::atomic::fence(Ordering::Acquire);
}

/// Writes `bytes` at `dst`, which another process may be reading at the
/// same moment: volatile byte stores (no reference is formed; a concurrent
/// reader sees at worst a torn record, which fails its tag). Ordering
/// against earlier writes is the caller's fence.
///
/// # Safety
/// `dst..dst + bytes.len()` is mapped, writable memory that stays mapped for
/// the call.
unsafe fn store_shared_bytes(dst: *mut u8, bytes: &[u8]) {
    for (i, byte) in bytes.iter().enumerate() {
        // SAFETY: `dst + i` lies inside the range the caller vouches for.
        unsafe { dst.add(i).write_volatile(*byte) };
    }
}

/// Publishes `body` at `offset + 8` of `region` (our own shared memory,
/// which other processes read: a mailbox) under the sequence word at
/// `offset`, seqlock-wise: the word goes odd, the bytes are written, the word
/// goes even with release ordering. A reader that sees the same even word
/// before and after copying the bytes saw them whole. The word's next value
/// follows whatever it holds (a process that maps the file may have changed
/// it: that costs freshness, never more, since every record carries its own
/// tag). `false`, writing nothing, when the range is not inside `region` or
/// the word is not 8-byte aligned.
pub(crate) fn publish_shared(
    region: &kvcr_ucx::Registration<'_>,
    offset: usize,
    body: &[u8],
) -> bool {
    let base = region.as_ptr().cast_mut();
    let fits = offset
        .checked_add(8)
        .and_then(|at| at.checked_add(body.len()))
        .is_some_and(|end| end <= region.len());
    if !fits || !(base as usize).wrapping_add(offset).is_multiple_of(8) {
        return false;
    }
    // SAFETY: `offset..offset + 8` lies inside the registration's live,
    // writable memory (checked above) and is 8-byte aligned (checked); the
    // word is only ever accessed atomically, here and by readers
    // (`PeerSegment::sequence`), and outlives this borrow.
    let word = unsafe { AtomicU64::from_ptr(base.add(offset).cast::<u64>()) };
    let odd = (word.load(Ordering::Relaxed) | 1).wrapping_add(2);
    word.store(odd, Ordering::Relaxed);
    std::sync::atomic::fence(Ordering::Release);
    // SAFETY: `offset + 8..offset + 8 + body.len()` lies inside the live,
    // writable registration (checked above); a reader copying concurrently
    // sees the word change.
    unsafe { store_shared_bytes(base.add(offset + 8), body) };
    word.store(odd.wrapping_add(1), Ordering::Release);
    true
}

/// Why a source did not map a target's segment (it writes through UCX then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SegmentRefusal {
    /// `/proc/<pid>/fd/<fd>` could not be opened (gone, not ours to open).
    Open,
    /// The file is not the memfd of the advertised name.
    Name,
    /// Not a regular file, shorter than the region, or not fully allocated.
    Size,
    /// Not sealed against shrinking.
    Seals,
    /// The kernel refused the mapping.
    Map,
}

impl SegmentRefusal {
    /// What was wrong, in words.
    pub(crate) fn why(self) -> &'static str {
        match self {
            Self::Open => "the pool file could not be opened",
            Self::Name => "the file is not the pool's memfd (its name differs)",
            Self::Size => "the pool file is not a fully allocated file of the pool's size",
            Self::Seals => "the pool file is not sealed against shrinking",
            Self::Map => "the kernel refused to map the pool file",
        }
    }
}

/// A target's pool, mapped into this (source) process for one-copy writes.
#[derive(Debug)]
pub(crate) struct PeerSegment {
    map: MmapRaw,
    /// The target's address of the segment's first byte (its region base).
    base: u64,
    /// One bit per [`POPULATE_CHUNK`] of the mapping: its page-table entries
    /// were made (a chunk is populated once, on its first write).
    populated: Box<[AtomicU64]>,
}

/// How much [`PeerSegment::populate_in_background`] populates per call
/// (and between looks at whether the route still holds the mapping).
/// Small, because each call holds this process's memory-map lock for
/// reading: a thread that wants it for writing (any `mmap`) waits out the
/// step, and every page fault behind that writer too, so a step must never
/// be long, even when the populator loses its CPU in the middle of one.
const BACKGROUND_STEP: u64 = 256 << 10;

/// How much of a mapping [`PeerSegment::populate_in_background`] populates
/// ahead, from its start: page-table entries cost 8 bytes per 4 KiB page
/// (0.2 % of what is mapped) in every source that maps the pool, so a
/// whole 256 GiB pool would cost each such source 512 MiB up front. 1 GiB
/// costs 2 MiB; past it, writes populate the granules they touch.
const BACKGROUND_LIMIT: u64 = 1 << 30;

/// Lowers the calling thread to the weakest nice level (best effort): it
/// then takes ~1.5 % of a CPU others want, and all of one nobody wants.
/// Not `SCHED_IDLE`: a thread starved in the middle of a step would hold
/// the memory-map lock (above) for as long as the host stays busy.
fn lowest_priority() {
    // SAFETY: plain integer arguments; `who` 0 with PRIO_PROCESS is the
    // calling thread on Linux.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
}

/// The granule of [`PeerSegment::prepare`]: a first write populates only
/// the granules it touches. It was 2 MiB: a first 256 KiB write into a
/// fresh chunk then populated 512 pages, and one-block restores had a tail
/// of one in eight (the chunks of a 16 MiB pool over 100 requests) at
/// 230–400 µs on the 2-vCPU VM and 1.2–1.7 ms on the H200 host. Runs of
/// granules are populated with one call, so bulk writes pay no more calls.
const POPULATE_CHUNK: u64 = 64 << 10;

impl PeerSegment {
    /// Opens the segment `segment` of the target `advert` describes, whose
    /// region starts at the target's address `base` and spans `extent`
    /// bytes, and maps those bytes. The caller has checked the scope.
    pub(crate) fn open(
        advert: &SharedMemoryAdvert,
        segment: &SegmentAdvert,
        base: u64,
        extent: u64,
    ) -> std::result::Result<Self, SegmentRefusal> {
        let path = format!("/proc/{}/fd/{}", advert.pid, segment.fd);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|_| SegmentRefusal::Open)?;
        // The name of what was opened (not of the path, which may have
        // changed since): only the advertised pool is written.
        inspect_pool_file(&file, &segment.token, extent)?;
        let len = usize::try_from(extent).map_err(|_| SegmentRefusal::Size)?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|_| SegmentRefusal::Map)?;
        // Where the target's pool has huge pages, each populate then makes
        // one entry per 2 MiB.
        advise_huge_pages(&map);
        let chunks = (len as u64).div_ceil(POPULATE_CHUNK);
        let populated = (0..chunks.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        Ok(Self {
            map,
            base,
            populated,
        })
    }

    /// Makes this process's page-table entries for the whole mapping, so
    /// writes take no faults (see [`populate_for_write`]).
    #[cfg(test)]
    pub(crate) fn populate(&self) {
        self.prepare(self.map.as_mut_ptr() as u64, self.map.len() as u64);
    }

    /// The word of [`PeerSegment::populated`] holding granule `chunk`'s
    /// bit, and that bit (`None` past the mapping).
    fn granule_bit(&self, chunk: u64) -> Option<(&AtomicU64, u64)> {
        let bits = self.populated.get(usize::try_from(chunk / 64).ok()?)?;
        Some((bits, 1 << (chunk % 64)))
    }

    /// The granules marked populated, in order.
    #[cfg(test)]
    fn populated_granules(&self) -> Vec<u64> {
        let granules = (self.map.len() as u64).div_ceil(POPULATE_CHUNK);
        (0..granules)
            .filter(|&g| {
                self.granule_bit(g)
                    .is_some_and(|(bits, bit)| bits.load(Ordering::Relaxed) & bit != 0)
            })
            .collect()
    }

    /// Whether the local range `dst..dst+len` lies inside this mapping.
    pub(crate) fn holds(&self, dst: u64, len: u64) -> bool {
        let start = self.map.as_mut_ptr() as u64;
        dst >= start && dst.saturating_add(len) <= start + self.map.len() as u64
    }

    /// Before a write of the local range `dst..dst+len` (inside this
    /// mapping): populates the chunks it touches that were never populated,
    /// so the copy takes no faults; chunks already done cost a bit test.
    pub(crate) fn prepare(&self, dst: u64, len: u64) {
        if !self.holds(dst, len) || len == 0 {
            return;
        }
        let start = self.map.as_mut_ptr() as u64;
        let first = (dst - start) / POPULATE_CHUNK;
        let last = (dst - start + len - 1) / POPULATE_CHUNK;
        // Consecutive granules not yet populated, populated by one call.
        let mut run: Option<std::ops::RangeInclusive<u64>> = None;
        for chunk in first..=last {
            let Some((bits, bit)) = self.granule_bit(chunk) else {
                break;
            };
            if bits.load(Ordering::Relaxed) & bit != 0 {
                if let Some(done) = run.take() {
                    self.populate_granules(done);
                }
                continue;
            }
            run = Some(run.map_or(chunk..=chunk, |r| *r.start()..=chunk));
        }
        if let Some(done) = run {
            self.populate_granules(done);
        }
    }

    /// Populates the mapping (its first [`BACKGROUND_LIMIT`] bytes) ahead of
    /// the writes, on a thread of its own at the lowest priority (it runs on
    /// CPUs nobody else wants, and takes little of one others do), a step of
    /// [`BACKGROUND_STEP`] at a time, skipping what a write populated
    /// first. It stops once the route lets go of the mapping (this thread
    /// then holds the last reference), so a replaced route's mapping goes
    /// soon after. The pages are the target's (its pool file is fully
    /// allocated, checked when opened): populating allocates only this
    /// process's page-table entries, which the writes would make anyway.
    /// Best effort: no thread, no population (writes populate as before).
    pub(crate) fn populate_in_background(self: &Arc<Self>) {
        let segment = Arc::clone(self);
        let _ = std::thread::Builder::new()
            .name("kvcr-populate".into())
            .spawn(move || {
                lowest_priority();
                let start = segment.map.as_mut_ptr() as u64;
                let len = (segment.map.len() as u64).min(BACKGROUND_LIMIT);
                let mut offset = 0;
                while offset < len && Arc::strong_count(&segment) > 1 {
                    let step = BACKGROUND_STEP.min(len - offset);
                    segment.prepare(start + offset, step);
                    offset += step;
                }
            });
    }

    /// Populates granules `chunks` (inside the mapping) with one call and
    /// marks them done.
    fn populate_granules(&self, chunks: std::ops::RangeInclusive<u64>) {
        let start = self.map.as_mut_ptr() as u64;
        let from = chunks.start() * POPULATE_CHUNK;
        let to = ((chunks.end() + 1) * POPULATE_CHUNK).min(self.map.len() as u64);
        if from >= to {
            return;
        }
        // SAFETY: `from..to` lies inside this live mapping (granules of
        // it, the last cut at its end).
        unsafe { populate_for_write(start + from, to - from) };
        for chunk in chunks {
            if let Some((bits, bit)) = self.granule_bit(chunk) {
                bits.fetch_or(bit, Ordering::Relaxed);
            }
        }
    }

    /// Writes `bytes` at the target's address `remote` (a doorbell record):
    /// `false`, writing nothing, when the range is not inside the mapping.
    /// Everything this thread saw written before (a write's bytes, copied
    /// by the lanes and reported to it) is visible to the target before
    /// these bytes are.
    pub(crate) fn write_record(&self, remote: u64, bytes: &[u8]) -> bool {
        let Some(dst) = self.destination(remote, bytes.len() as u64) else {
            return false;
        };
        std::sync::atomic::fence(Ordering::Release);
        // SAFETY: the whole range lies inside this live, writable shared
        // mapping (`destination` checked it).
        unsafe { store_shared_bytes(dst as usize as *mut u8, bytes) };
        true
    }

    /// The sequence word at the target's `remote` (a mailbox's, see
    /// [`publish_shared`]), loaded with acquire ordering; `None` when it is
    /// not inside the mapping or not 8-byte aligned.
    pub(crate) fn sequence(&self, remote: u64) -> Option<u64> {
        let at = self.destination(remote, 8)?;
        if !at.is_multiple_of(8) {
            return None;
        }
        // SAFETY: `at..at + 8` lies inside this live shared mapping
        // (`destination` checked it) and is aligned; the word is only ever
        // accessed atomically (by its writer, `publish_shared`), and any
        // value it holds is a valid `u64`.
        let word = unsafe { AtomicU64::from_ptr(at as usize as *mut u64) };
        Some(word.load(Ordering::Acquire))
    }

    /// Reads `out.len()` bytes at the target's `remote`, which the target
    /// (or any process mapping the file) may be writing now: volatile byte
    /// loads, then an acquire fence. `false`, reading nothing, when the range
    /// is not inside the mapping.
    pub(crate) fn read_record(&self, remote: u64, out: &mut [u8]) -> bool {
        let Some(src) = self.destination(remote, out.len() as u64) else {
            return false;
        };
        // SAFETY: the whole range lies inside this live shared mapping
        // (`destination` checked it).
        unsafe { load_shared_bytes(src as usize as *const u8, out) };
        true
    }

    /// The local address of the target's `remote..remote+len`, if the whole
    /// range is inside the mapping.
    pub(crate) fn destination(&self, remote: u64, len: u64) -> Option<u64> {
        let offset = remote.checked_sub(self.base)?;
        let end = offset.checked_add(len)?;
        (end <= self.map.len() as u64).then(|| self.map.as_mut_ptr() as u64 + offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcr_contracts::protocol::RegionId;

    fn advert_of(pool: &SharedPool) -> SharedMemoryAdvert {
        let scope = HostScope::current().unwrap();
        SharedMemoryAdvert {
            boot_id: scope.boot_id,
            pid_namespace: scope.pid_namespace,
            pid: std::process::id(),
            segments: vec![pool.advert(RegionId(0))],
        }
    }

    #[test]
    fn a_pool_maps_through_proc_and_writes_land_in_it() {
        let pool = SharedPool::create(1 << 20, true).unwrap();
        let advert = advert_of(&pool);
        assert!(HostScope::current().unwrap().matches(&advert));
        let segment = PeerSegment::open(&advert, &advert.segments[0], 0x1000, 1 << 20).unwrap();
        let dst = segment.destination(0x1000 + 4096, 8).unwrap();
        // SAFETY: `dst` is inside the mapping (checked just above).
        unsafe { (dst as *mut u64).write_unaligned(0x0123_4567_89ab_cdef) };
        // SAFETY: offset 4096 + 8 bytes is inside the pool.
        let seen = unsafe {
            (kvcr_ucx::OwnedMemory::as_mut_ptr(&pool).add(4096) as *const u64).read_unaligned()
        };
        assert_eq!(seen, 0x0123_4567_89ab_cdef);
        assert_eq!(segment.destination(0x1000 + (1 << 20) - 4, 8), None);
        assert_eq!(segment.destination(0xfff, 1), None);
        assert_eq!(segment.destination(u64::MAX, 2), None);
    }

    /// A first write populates the granules it touches and no others; a
    /// write over populated and fresh granules populates the fresh ones;
    /// ranges outside the mapping populate nothing.
    #[test]
    fn a_first_write_populates_only_the_granules_it_touches() {
        let len = 16 * POPULATE_CHUNK + 4096;
        let pool = SharedPool::create(len, true).unwrap();
        let advert = advert_of(&pool);
        let segment = PeerSegment::open(&advert, &advert.segments[0], 0, len).unwrap();
        let local = |offset: u64| segment.destination(offset, 1).unwrap();
        assert!(segment.populated_granules().is_empty());
        segment.prepare(local(100_000), 200_000);
        assert_eq!(segment.populated_granules(), vec![1, 2, 3, 4]);
        segment.prepare(local(0), 7 * POPULATE_CHUNK);
        assert_eq!(segment.populated_granules(), (0..7).collect::<Vec<_>>());
        // The short last granule, cut at the mapping's end.
        segment.prepare(local(len - 10), 10);
        assert_eq!(segment.populated_granules().last(), Some(&16));
        // Outside the mapping, or empty: nothing.
        segment.prepare(local(len - 10), 11);
        segment.prepare(local(9 * POPULATE_CHUNK), 0);
        segment.prepare(0, 4096);
        assert_eq!(segment.populated_granules().len(), 8);
        // Populating changes no byte of the pool.
        // SAFETY: offset 100_000 is inside the pool, written by no one.
        let byte = unsafe { *kvcr_ucx::OwnedMemory::as_mut_ptr(&pool).add(100_000) };
        assert_eq!(byte, 0);
    }

    /// This thread's minor page faults so far.
    fn minor_faults() -> i64 {
        // SAFETY: an all-zero `rusage` is a valid value to overwrite.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is a valid, writable rusage for the call.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
        assert_eq!(rc, 0, "getrusage");
        usage.ru_minflt
    }

    /// What `prepare` is for: the write after it takes no fault per 4 KiB
    /// page, although it populates with read faults (the entries of a
    /// shared memory mapping are writable after a read). Without it the
    /// same write into a fresh mapping takes one per page.
    #[test]
    fn a_prepared_write_takes_no_fault_per_page() {
        const LEN: u64 = 4 << 20;
        const PAGES: i64 = (LEN / 4096) as i64;
        let pool = SharedPool::create(LEN, true).unwrap();
        let advert = advert_of(&pool);
        let fill = vec![0x5au8; LEN as usize];
        let write_faults = |prepare: bool| {
            let segment = PeerSegment::open(&advert, &advert.segments[0], 0, LEN).unwrap();
            let dst = segment.destination(0, LEN).unwrap();
            if prepare {
                segment.prepare(dst, LEN);
            }
            let before = minor_faults();
            // SAFETY: `dst..dst+LEN` is this live mapping of the pool, which
            // nothing else touches during the test; `fill` is distinct.
            unsafe {
                std::ptr::copy_nonoverlapping(fill.as_ptr(), dst as usize as *mut u8, LEN as usize)
            };
            minor_faults() - before
        };
        let cold = write_faults(false);
        let prepared = write_faults(true);
        // Cold, one fault per page where shared memory has no huge pages
        // (this host kind); the count at least shows faults are seen.
        assert!(
            cold > prepared,
            "a cold write faulted {cold} times, a prepared one {prepared}"
        );
        assert!(
            prepared <= PAGES / 64,
            "a prepared write faulted {prepared} times"
        );
        // The bytes went to the pool.
        // SAFETY: offset LEN - 1 is inside the pool, written above.
        let last = unsafe { *kvcr_ucx::OwnedMemory::as_mut_ptr(&pool).add(LEN as usize - 1) };
        assert_eq!(last, 0x5a);
    }

    /// Huge pages exactly where the host lets shared memory have them: then
    /// the pool's own mapping and a source's mapping of it are mapped 2 MiB
    /// at a time (at least one of the pool's four huge pages: the kernel
    /// may fail to find a free 2 MiB page); elsewhere 4 KiB at a time.
    /// Either way a write through the source's mapping lands in the pool.
    /// (This host kind has `shmem_enabled` at `never`; the other branch was
    /// run by hand with it at `advise`.)
    #[test]
    fn pools_have_huge_pages_where_the_host_allows_them() {
        const LEN: u64 = 8 << 20;
        let pool = SharedPool::create(LEN, true).unwrap();
        let own = kvcr_ucx::OwnedMemory::as_mut_ptr(&pool) as u64;
        let advert = advert_of(&pool);
        let segment = PeerSegment::open(&advert, &advert.segments[0], 0, LEN).unwrap();
        let dst = segment.destination(0, LEN).unwrap();
        segment.prepare(dst, LEN);
        let huge = crate::placement::huge_page_bytes(&[(own, LEN), (dst, LEN)]);
        let (own_huge, peer_huge) = (huge[0], huge[1]);
        if crate::placement::shared_memory_huge_pages() {
            assert!(
                own_huge >= HUGE_PAGE && peer_huge >= HUGE_PAGE,
                "huge pages allowed, yet the pool has {own_huge} bytes of them \
                 and its peer mapping {peer_huge}"
            );
        } else {
            assert_eq!((own_huge, peer_huge), (0, 0));
        }
        // SAFETY: `dst + LEN - 8` is inside the live mapping, which nothing
        // else touches during the test.
        unsafe { ((dst + LEN - 8) as usize as *mut u64).write_unaligned(0xfeed_f00d) };
        // SAFETY: the same 8 bytes of the pool, read after the write.
        let seen = unsafe {
            (kvcr_ucx::OwnedMemory::as_mut_ptr(&pool).add(LEN as usize - 8) as *const u64)
                .read_unaligned()
        };
        assert_eq!(seen, 0xfeed_f00d);
    }

    /// The background populator covers the whole mapping while the route
    /// holds it, and lets go of a mapping the route dropped.
    #[test]
    // The populator is a detached thread with no completion to wait on:
    // the test polls its effects, bounded.
    #[allow(clippy::disallowed_methods)]
    fn a_mapping_is_populated_in_the_background_until_let_go() {
        let len = 3 * BACKGROUND_STEP + 5 * POPULATE_CHUNK;
        let pool = SharedPool::create(len, true).unwrap();
        let advert = advert_of(&pool);
        let segment = Arc::new(PeerSegment::open(&advert, &advert.segments[0], 0, len).unwrap());
        segment.populate_in_background();
        let all = len.div_ceil(POPULATE_CHUNK) as usize;
        let began = std::time::Instant::now();
        while segment.populated_granules().len() < all {
            assert!(
                began.elapsed() < std::time::Duration::from_secs(30),
                "never populated"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Let go at once: the populator's reference goes too.
        let dropped = Arc::new(PeerSegment::open(&advert, &advert.segments[0], 0, len).unwrap());
        dropped.populate_in_background();
        let weak = Arc::downgrade(&dropped);
        drop(dropped);
        let began = std::time::Instant::now();
        while weak.upgrade().is_some() {
            assert!(
                began.elapsed() < std::time::Duration::from_secs(30),
                "never let go"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[test]
    fn a_segment_named_wrongly_or_too_short_or_unsealed_is_refused() {
        let pool = SharedPool::create(1 << 16, false).unwrap();
        let advert = advert_of(&pool);
        let mut forged = advert.segments[0];
        forged.token[0] ^= 1;
        assert_eq!(
            PeerSegment::open(&advert, &forged, 0, 1).unwrap_err(),
            SegmentRefusal::Name
        );
        assert_eq!(
            PeerSegment::open(&advert, &advert.segments[0], 0, (1 << 16) + 1).unwrap_err(),
            SegmentRefusal::Size
        );
        // Another descriptor of this process: not a pool.
        let other = File::open("/proc/self/status").unwrap();
        let mut stray = advert.segments[0];
        stray.fd = other.as_raw_fd() as u32;
        assert_eq!(
            PeerSegment::open(&advert, &stray, 0, 1).unwrap_err(),
            SegmentRefusal::Name
        );
        let mut closed = advert.segments[0];
        closed.fd = 1 << 20;
        assert_eq!(
            PeerSegment::open(&advert, &closed, 0, 1).unwrap_err(),
            SegmentRefusal::Open
        );
    }

    /// A memfd named like a pool of `token`, of `len` bytes, optionally
    /// sealed against shrinking and optionally allocated.
    fn lookalike(token: [u8; 16], len: u64, seal: bool, allocate: bool) -> File {
        let name = CString::new(format!("{NAME_PREFIX}{}", hex(&token))).unwrap();
        // SAFETY: valid name; the fd is owned by the File at once.
        let file = unsafe {
            File::from_raw_fd(libc::memfd_create(
                name.as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            ))
        };
        file.set_len(len).unwrap();
        if allocate {
            // SAFETY: our own memfd, within its size.
            let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as i64) };
            assert_eq!(rc, 0);
        }
        if seal {
            // SAFETY: our own memfd.
            let rc =
                unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
            assert_eq!(rc, 0);
        }
        file
    }

    #[test]
    fn an_unsealed_or_sparse_lookalike_is_refused() {
        let token = [0x42; 16];
        let scope = HostScope::current().unwrap();
        let advert_for = |file: &File| {
            let segment = SegmentAdvert {
                region: RegionId(0),
                fd: file.as_raw_fd() as u32,
                token,
            };
            (
                SharedMemoryAdvert {
                    boot_id: scope.boot_id,
                    pid_namespace: scope.pid_namespace,
                    pid: std::process::id(),
                    segments: vec![segment],
                },
                segment,
            )
        };
        let unsealed = lookalike(token, 1 << 16, false, true);
        let (advert, segment) = advert_for(&unsealed);
        assert_eq!(
            PeerSegment::open(&advert, &segment, 0, 1 << 16).unwrap_err(),
            SegmentRefusal::Seals
        );
        // Sparse: 1 GiB that costs its owner nothing, which our writes would
        // have allocated.
        let sparse = lookalike(token, 1 << 30, true, false);
        let (advert, segment) = advert_for(&sparse);
        assert_eq!(
            PeerSegment::open(&advert, &segment, 0, 1 << 30).unwrap_err(),
            SegmentRefusal::Size
        );
        let good = lookalike(token, 1 << 16, true, true);
        let (advert, segment) = advert_for(&good);
        let view = PeerSegment::open(&advert, &segment, 0, 1 << 16).unwrap();
        view.populate();
        assert!(view.destination(0, 1 << 16).is_some());
    }

    #[test]
    fn shared_reads_stay_inside_the_registration() {
        let context = kvcr_ucx::Context::new().unwrap();
        let region = context.register_vec((0..=255u8).collect()).unwrap();
        let mut out = [0u8; 4];
        assert!(read_shared(&region, 252, &mut out));
        assert_eq!(out, [252, 253, 254, 255]);
        for offset in [253, 256, usize::MAX] {
            let mut out = [7u8; 4];
            assert!(!read_shared(&region, offset, &mut out), "offset {offset}");
            assert_eq!(out, [7; 4], "nothing read");
        }
    }

    #[test]
    fn boot_ids_parse_and_bad_ones_do_not() {
        assert_eq!(
            parse_uuid("00112233-4455-6677-8899-aabbccddeeff"),
            Some([
                0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
                0xee, 0xff
            ])
        );
        assert_eq!(parse_uuid("0011"), None);
        assert_eq!(parse_uuid("zz112233-4455-6677-8899-aabbccddeeff"), None);
    }
}
