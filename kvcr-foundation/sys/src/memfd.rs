//! Sealed memfd files and their shared mappings: the pools a peer-mode
//! runner owns ([`SharedPool`]), the files a guard makes for the runners it
//! serves ([`create_pool_file`], [`create_journal_file`]), the residency
//! journal's mapping ([`JournalMap`]), and the checks a file must pass
//! before anything maps it.
//!
//! A target advertises a pool file (its pid and fd, a random name token)
//! with its metadata; a source on the same host and in the same pid
//! namespace opens `/proc/<pid>/fd/<fd>`, checks the file and maps it
//! ([`crate::segment::PeerSegment`]). What a source checks before it maps
//! anything a target named:
//! * the host (kernel boot id) and pid namespace are its own ([`HostScope`]);
//! * the file opened is a memfd named `kvcr-pool-<token>` with the
//!   advertised token (checked on the opened descriptor, not the path);
//! * the file is sealed against shrinking, so it can never become shorter
//!   than the mapping (no `SIGBUS` on a write), and fully allocated, so no
//!   write of ours allocates memory on the target's behalf (a sparse file
//!   could make us commit memory without bound).
//!
//! The kernel's own rule covers the rest: opening another process's
//! descriptor through `/proc` needs the access `ptrace` read mode needs
//! (same user, dumpable), the access a same-host peer already has to write
//! that process's memory.
//!
//! Unsafe, named: `memfd_create`, `fallocate`, `fcntl` seals, `madvise`,
//! the journal's `mmap`, pre-faulting volatile writes.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;

use kvcr_contracts::protocol::{SegmentAdvert, SharedMemoryAdvert};
use memmap2::{MmapOptions, MmapRaw};

use crate::error::{Result, SysError};
use crate::segment::SegmentRefusal;

/// Prefix of a pool file's name (`memfd:` names show in `/proc/*/fd`).
pub(crate) const NAME_PREFIX: &str = "kvcr-pool-";

/// Where this process runs: the kernel boot and the pid namespace. Two
/// processes with equal scopes can reach each other's descriptors through
/// `/proc/<pid>/fd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostScope {
    /// The kernel's boot id.
    pub boot_id: [u8; 16],
    /// The pid namespace's inode.
    pub pid_namespace: u64,
}

impl HostScope {
    /// This process's scope; `None` when `/proc` does not tell.
    pub fn current() -> Option<Self> {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let boot_id = parse_uuid(text.trim())?;
        let pid_namespace = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
        Some(Self {
            boot_id,
            pid_namespace,
        })
    }

    /// Whether a target advertising `advert` runs in this scope.
    pub fn matches(&self, advert: &SharedMemoryAdvert) -> bool {
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

pub(crate) fn hex(token: &[u8; 16]) -> String {
    token.iter().map(|b| format!("{b:02x}")).collect()
}

fn os_error(call: &'static str) -> SysError {
    SysError::os(call)
}

/// A pool backed by a sealed memfd, mapped shared. Owned by the UCX
/// registration (which unmaps it from UCX before dropping it); the file
/// stays open for the pool's life so same-host sources can reach it.
///
/// Field order is drop order: the mapping goes before the file.
#[derive(Debug)]
pub struct SharedPool {
    map: MmapRaw,
    file: File,
    token: [u8; 16],
}

impl SharedPool {
    /// A zeroed pool of `len` bytes (a multiple of the page size is not
    /// required); with `prefault`, every page is touched now, so neither
    /// this process nor a peer's first write pays the fault.
    pub fn create(len: u64, prefault: bool) -> Result<Self> {
        let (file, token) = create_pool_file(len)?;
        Self::map(file, token, len, prefault)
    }

    /// A pool in a file made by [`create_pool_file`] in this or another
    /// process (a guard hands one over): its name must carry `token`, its
    /// size be `len` and its seals be in place, checked on the descriptor.
    /// Its bytes are kept: with `prefault` the pages are populated without
    /// being written (a recovered pool holds pages).
    pub fn adopt(file: File, token: [u8; 16], len: u64, prefault: bool) -> Result<Self> {
        check_pool_file(&file, &token, len)?;
        let pool = Self::map(file, token, len, false)?;
        if prefault {
            // SAFETY: the range is exactly our live mapping.
            unsafe { populate_for_write(pool.map.as_mut_ptr() as u64, pool.map.len() as u64) };
        }
        Ok(pool)
    }

    fn map(file: File, token: [u8; 16], len: u64, prefault: bool) -> Result<Self> {
        let size = usize::try_from(len).map_err(|_| SysError::Allocation { bytes: len })?;
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
    pub fn advert(&self, region: kvcr_contracts::protocol::RegionId) -> SegmentAdvert {
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
pub fn create_pool_file(len: u64) -> Result<(File, [u8; 16])> {
    let huge = len >= HUGE_PAGE && crate::placement::shared_memory_huge_pages();
    create_sealed_file(NAME_PREFIX, len, huge)
}

/// The transparent-huge-page size, as a file length.
pub(crate) const HUGE_PAGE: u64 = crate::placement::HUGE_PAGE as u64;

/// Makes a residency journal's file: a memfd like a pool's, named
/// `kvcr-journal-<token>` (never taken for a pool: a source checks the name).
pub fn create_journal_file(len: u64) -> Result<File> {
    create_sealed_file("kvcr-journal-", len, false).map(|(file, _)| file)
}

fn create_sealed_file(prefix: &str, len: u64, huge: bool) -> Result<(File, [u8; 16])> {
    let failed = || SysError::Allocation { bytes: len };
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
pub struct JournalMap {
    map: memmap2::MmapMut,
}

impl JournalMap {
    /// Maps all of `file` (at least `min_len` bytes, sealed against
    /// shrinking: a mapping of a file that shrinks faults).
    pub fn new(file: &File, min_len: u64) -> Result<Self> {
        let bad = |why| SysError::Grant { why };
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

    /// The journal's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The journal's bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// Checks an opened pool file on its descriptor: a memfd named for `token`
/// (the name of what was opened, not of a path that may have changed), at
/// least `extent` bytes long and allocated, sealed against shrinking.
pub(crate) fn inspect_pool_file(
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
        Ok(()) => Err(SysError::Grant {
            why: "a granted pool file is not the pool's size",
        }),
        Err(refusal) => Err(SysError::Grant { why: refusal.why() }),
    }
}

/// Asks for huge-page mappings of a pool file (`MADV_HUGEPAGE`), when the
/// host allows shared memory to have them and the mapping spans one. Best
/// effort: without them the mapping works with 4 KiB pages.
pub(crate) fn advise_huge_pages(map: &MmapRaw) {
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
pub unsafe fn populate_for_write(addr: u64, len: u64) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
