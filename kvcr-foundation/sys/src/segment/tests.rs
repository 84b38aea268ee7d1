//! The segment's tests: pools mapped through `/proc`, population, and the
//! refusals of files that are not what they claim.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;

use kvcr_contracts::protocol::{RegionId, SegmentAdvert, SharedMemoryAdvert};

use super::*;
use crate::memfd::{HUGE_PAGE, HostScope, NAME_PREFIX, SharedPool, hex};

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
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
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
