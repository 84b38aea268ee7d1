//! [`PeerSegment`]: a same-host target's pool file, mapped into this
//! (source) process for one-copy writes, populated ahead of the writes, and
//! the doorbell records and mailbox words read and written through it.
//!
//! The file is checked before it is mapped ([`crate::memfd`]), and every
//! access through the mapping is bounds-checked against it
//! ([`PeerSegment::destination`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvcr_contracts::protocol::{SegmentAdvert, SharedMemoryAdvert};
use memmap2::{MmapOptions, MmapRaw};

use crate::memfd::{advise_huge_pages, inspect_pool_file, populate_for_write};
use crate::seqlock::{load_shared_bytes, store_shared_bytes};

#[cfg(test)]
mod tests;

/// Why a source did not map a target's segment (it writes through UCX then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentRefusal {
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
    pub fn why(self) -> &'static str {
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
pub struct PeerSegment {
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
    pub fn open(
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
    pub fn holds(&self, dst: u64, len: u64) -> bool {
        let start = self.map.as_mut_ptr() as u64;
        dst >= start && dst.saturating_add(len) <= start + self.map.len() as u64
    }

    /// Before a write of the local range `dst..dst+len` (inside this
    /// mapping): populates the chunks it touches that were never populated,
    /// so the copy takes no faults; chunks already done cost a bit test.
    pub fn prepare(&self, dst: u64, len: u64) {
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

    /// Populates the mapping (its first `BACKGROUND_LIMIT` bytes) ahead of
    /// the writes, on a thread of its own at the lowest priority (it runs on
    /// CPUs nobody else wants, and takes little of one others do), a step of
    /// `BACKGROUND_STEP` at a time, skipping what a write populated
    /// first. It stops once the route lets go of the mapping (this thread
    /// then holds the last reference), so a replaced route's mapping goes
    /// soon after. The pages are the target's (its pool file is fully
    /// allocated, checked when opened): populating allocates only this
    /// process's page-table entries, which the writes would make anyway.
    /// Best effort: no thread, no population (writes populate as before).
    pub fn populate_in_background(self: &Arc<Self>) {
        let segment = Arc::clone(self);
        let _ = std::thread::Builder::new()
            .name("kvcr-populate".into())
            .spawn(move || {
                crate::thread::lowest_priority();
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
    pub fn write_record(&self, remote: u64, bytes: &[u8]) -> bool {
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
    /// [`publish_shared`](crate::seqlock::publish_shared)), loaded with acquire ordering; `None` when it is
    /// not inside the mapping or not 8-byte aligned.
    pub fn sequence(&self, remote: u64) -> Option<u64> {
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
    pub fn read_record(&self, remote: u64, out: &mut [u8]) -> bool {
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
    pub fn destination(&self, remote: u64, len: u64) -> Option<u64> {
        let offset = remote.checked_sub(self.base)?;
        let end = offset.checked_add(len)?;
        (end <= self.map.len() as u64).then(|| self.map.as_mut_ptr() as u64 + offset)
    }
}
