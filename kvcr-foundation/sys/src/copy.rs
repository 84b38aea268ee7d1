//! Copies between plain addresses: the span copy kernels (plain, or
//! streamed with non-temporal stores for large spans) and the
//! [`MemoryRegistry`] that makes them safe to call.
//!
//! The kernels are `unsafe`: their callers vouch for every byte (the
//! runner's sans-I/O core bounds-checks spans against registrations). The
//! registry takes that promise once, where memory is registered, and then
//! checks every span of every copy against what was registered (a binary
//! search per span, under one read lock per call), so copying through it
//! is safe: a span outside every registered range is a typed error and
//! nothing is copied.

use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use crate::error::{Result, SysError};
use crate::segment::PeerSegment;

/// One copy: `len` bytes from `src` to `dst` (plain addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ByteSpan {
    /// First source byte.
    pub src: u64,
    /// First destination byte.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

impl ByteSpan {
    /// `len` bytes from `src` to `dst`.
    pub const fn new(src: u64, dst: u64, len: u64) -> Self {
        Self { src, dst, len }
    }
}

/// Performs the copies.
///
/// # Safety
/// 1. Every `src..src+len` range must be valid for reads and every
///    `dst..dst+len` range valid for writes for the duration of the call.
/// 2. No other thread may access a destination range, or write a source range,
///    during the call.
/// 3. A span's source and destination ranges must not overlap.
pub(crate) unsafe fn copy_spans(spans: impl IntoIterator<Item = ByteSpan>) {
    for span in spans {
        let len = span.len as usize;
        // SAFETY: guaranteed by this function's contract (1)-(3): both ranges
        // are valid, not concurrently accessed, and do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                span.src as usize as *const u8,
                span.dst as usize as *mut u8,
                len,
            );
        }
    }
}

/// Spans at least this long are streamed (see [`MemoryRegistry::copy_streaming`]).
pub const STREAM_MIN: u64 = 256 << 10;

/// Like [`copy_spans`], but spans of [`STREAM_MIN`] or more are written with
/// non-temporal stores, ending with a store fence. Why: glibc's `memcpy`
/// streams only above a threshold derived from the cache size, so on a host
/// with a large L3 a 16 MiB page is copied with ordinary stores, which read
/// every destination line first: 5.0 GB/s on the H200 host against 8.2 for
/// one 1 GiB `memcpy` (measured, one thread). A peer's page is read next by
/// the destination's restore, not by this thread, so caching it here buys
/// nothing.
///
/// # Safety
/// As [`copy_spans`].
pub(crate) unsafe fn copy_spans_streaming(spans: impl IntoIterator<Item = ByteSpan>) {
    #[cfg(target_arch = "x86_64")]
    {
        for span in spans {
            let (src, dst) = (span.src as usize as *const u8, span.dst as usize as *mut u8);
            let len = span.len as usize;
            if span.len >= STREAM_MIN {
                // SAFETY: this function's contract, per span.
                unsafe { stream_copy(dst, src, len) };
            } else {
                // SAFETY: this function's contract, per span.
                unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            }
        }
        // Non-temporal stores are weakly ordered: fence them before anyone
        // is told the bytes are there. SSE2 is baseline on x86_64.
        // SAFETY: a store fence has no operands.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: this function's contract.
    unsafe {
        copy_spans(spans)
    };
}

/// Copies `len` bytes with 16-byte non-temporal stores into 64-byte aligned
/// destination lines (the unaligned head and tail with `memcpy`). The caller
/// fences.
///
/// # Safety
/// `src..src+len` valid for reads, `dst..dst+len` valid for writes, not
/// overlapping, neither accessed by anyone else during the call.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(64).min(len);
    // SAFETY: the first `head <= len` bytes of both ranges (the contract).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut offset = head;
    while offset + 64 <= len {
        // SAFETY: `offset..offset+64` lies inside both ranges (loop bound);
        // `dst + offset` is 64-byte aligned (after the head), as the
        // streaming store requires 16; loads are unaligned. SSE2 is
        // baseline on x86_64.
        unsafe {
            let s = src.add(offset).cast::<__m128i>();
            let d = dst.add(offset).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        offset += 64;
    }
    // SAFETY: the last `len - offset < 64` bytes of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(offset), dst.add(offset), len - offset) };
}

/// Borrows `len` bytes at `addr`.
///
/// # Safety
/// `addr..addr+len` must be valid for reads for `'a`, and nothing may write it
/// during `'a`.
pub unsafe fn bytes_at<'a>(addr: u64, len: u64) -> &'a [u8] {
    // SAFETY: guaranteed by this function's contract.
    unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len as usize) }
}

/// One registered range.
pub(crate) struct Registered {
    start: u64,
    end: u64,
    /// Copies may write it (`false`: a buffer lent for reading only, see
    /// [`MemoryRegistry::lend`]).
    writable: bool,
    /// Keeps memory this crate owns mapped while it is registered (`None`:
    /// a caller's range, valid by its [`MemoryRegistry::insert`] promise).
    _owner: Option<Arc<dyn kvcr_ucx::OwnedMemory + Send + Sync>>,
}

/// The address ranges copies may touch, sorted and disjoint.
///
/// The model: registered memory is never seen through a Rust reference,
/// only through this registry's raw copies (and other processes' mappings
/// of it, for shared pools), exactly as memory another process writes.
/// Which copy may touch which bytes when is the caller's protocol (the
/// runner's core: claims, FILLING and READY slots); the registry answers
/// only whether bytes are there to touch, and whether copies may write them
/// (a buffer [lent](MemoryRegistry::lend) for reading only is never a
/// destination). Removing a range waits for the copies in flight (each
/// holds the read lock for its whole copy), so no copy outlives the range
/// it was checked against.
#[derive(Default)]
pub struct MemoryRegistry {
    ranges: RwLock<Vec<Registered>>,
}

impl std::fmt::Debug for MemoryRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges = self.read_lock();
        f.debug_list()
            .entries(
                ranges
                    .iter()
                    .map(|r| format!("{:#x}..{:#x}", r.start, r.end)),
            )
            .finish()
    }
}

impl MemoryRegistry {
    /// An empty registry: every copy through it is refused.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a caller's `len` bytes at `base` (an engine's region).
    ///
    /// # Safety
    /// `base..base + len` must stay valid for reads and writes until it is
    /// [removed](Self::remove) or the registry is dropped, must not be
    /// accessed through Rust references meanwhile, and the caller's protocol
    /// must keep two copies from writing the same bytes (or one writing
    /// what another reads) at the same time.
    pub unsafe fn insert(&self, base: u64, len: u64) -> Result<()> {
        self.insert_range(base, len, None, true)
    }

    /// Registers memory this process owns (a pool, a mapping), kept alive by
    /// the registry until it is removed. Safe: [`kvcr_ucx::OwnedMemory`]'s
    /// contract is that the bytes stay valid while the value lives.
    pub fn insert_owned(&self, memory: Arc<dyn kvcr_ucx::OwnedMemory + Send + Sync>) -> Result<()> {
        let base = memory.as_mut_ptr() as usize as u64;
        let len = memory.byte_len() as u64;
        self.insert_range(base, len, Some(memory), true)
    }

    /// Inserts `base..base + len` (kept alive by `owner`, if any; written
    /// by copies only if `writable`).
    pub(crate) fn insert_range(
        &self,
        base: u64,
        len: u64,
        owner: Option<Arc<dyn kvcr_ucx::OwnedMemory + Send + Sync>>,
        writable: bool,
    ) -> Result<()> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(SysError::Unregistered { addr: base, len })?;
        let mut ranges = self.ranges.write().unwrap_or_else(PoisonError::into_inner);
        let at = ranges.partition_point(|r| r.start < base);
        let clear_before = at == 0 || ranges.get(at - 1).is_some_and(|r| r.end <= base);
        let clear_after = ranges.get(at).is_none_or(|r| end <= r.start);
        if !clear_before || !clear_after {
            return Err(SysError::AlreadyRegistered { addr: base, len });
        }
        ranges.insert(
            at,
            Registered {
                start: base,
                end,
                writable,
                _owner: owner,
            },
        );
        Ok(())
    }

    /// Removes the range starting at `base`, once no copy through the
    /// registry is in flight; `false` when none starts there. Memory
    /// inserted with [`Self::insert_owned`] is released here (if the
    /// registry held its last reference).
    pub fn remove(&self, base: u64) -> bool {
        let mut ranges = self.ranges.write().unwrap_or_else(PoisonError::into_inner);
        let at = ranges.partition_point(|r| r.start < base);
        if ranges.get(at).is_some_and(|r| r.start == base) {
            ranges.remove(at);
            true
        } else {
            false
        }
    }

    /// Whether `addr..addr + len` lies inside one registered range.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        holds(&self.read_lock(), addr, len)
    }

    /// Copies `spans` after checking each against the registry (a refusal
    /// copies nothing).
    pub fn copy<I>(&self, spans: I) -> Result<()>
    where
        I: IntoIterator<Item = ByteSpan> + Clone,
    {
        let ranges = self.checked(spans.clone())?;
        // SAFETY: every range lies inside a registered range (checked just
        // now, under the read lock held until the copy ends, so none is
        // removed meanwhile), valid by `insert`'s promise or owned; no span
        // overlaps itself (checked); concurrent access is the inserting
        // caller's protocol (`insert`'s contract).
        unsafe { copy_spans(spans) };
        drop(ranges);
        Ok(())
    }

    /// As [`Self::copy`], with spans of [`STREAM_MIN`] bytes or more
    /// written with non-temporal stores (fenced before this returns).
    pub fn copy_streaming<I>(&self, spans: I) -> Result<()>
    where
        I: IntoIterator<Item = ByteSpan> + Clone,
    {
        let ranges = self.checked(spans.clone())?;
        // SAFETY: as in `copy`.
        unsafe { copy_spans_streaming(spans) };
        drop(ranges);
        Ok(())
    }

    /// As [`Self::copy_streaming`], where a destination may also lie inside
    /// one of `segments` (a same-host peer's pools, mapped here; the borrow
    /// keeps them mapped for the call). One read lock for the whole call.
    pub fn copy_streaming_into<I>(&self, spans: I, segments: &[Arc<PeerSegment>]) -> Result<()>
    where
        I: IntoIterator<Item = ByteSpan> + Clone,
    {
        let in_segment = |dst: u64, len: u64| segments.iter().any(|s| s.holds(dst, len));
        let ranges = self.checked_into(spans.clone(), in_segment)?;
        // SAFETY: as in `copy`; a destination inside a segment is inside a
        // live shared mapping (borrowed for the call), writable, and the
        // write's target granted it to this copy alone (the caller's
        // protocol, as for registered memory).
        unsafe { copy_spans_streaming(spans) };
        drop(ranges);
        Ok(())
    }

    /// A copy of the `len` bytes at `addr`, which must be registered.
    pub fn read(&self, addr: u64, len: u64) -> Result<Vec<u8>> {
        let ranges = self.read_lock();
        if !holds(&ranges, addr, len) {
            return Err(SysError::Unregistered { addr, len });
        }
        // SAFETY: the range is registered (checked under the lock held until
        // the copy is made); writers of it are the caller's protocol.
        let bytes = unsafe { bytes_at(addr, len) }.to_vec();
        drop(ranges);
        Ok(bytes)
    }

    /// Copies `bytes` (memory of the caller's, such as a received message)
    /// to the registered `dst..dst + bytes.len()`.
    pub fn write(&self, dst: u64, bytes: &[u8]) -> Result<()> {
        let len = bytes.len() as u64;
        let ranges = self.read_lock();
        if !holds_writable(&ranges, dst, len) {
            return Err(SysError::Unregistered { addr: dst, len });
        }
        // SAFETY: the destination is registered writable (checked under the
        // lock held until the copy is made), so valid for writes; `bytes` is
        // a borrowed slice, which writable registered memory never backs (it
        // is never seen through a reference, or is lent exclusively by a
        // caller that cannot reach it during the loan), so they do not
        // overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as usize as *mut u8, bytes.len());
        }
        drop(ranges);
        Ok(())
    }

    /// Writes `head`, then the registered `pieces` (address, length), to
    /// `socket` in one vectored write without blocking (see
    /// `vectored::try_write_spans`).
    pub fn try_write_vectored(
        &self,
        socket: &tokio::net::TcpStream,
        head: Option<&[u8]>,
        pieces: &[(u64, u64)],
    ) -> std::io::Result<usize> {
        let ranges = self.read_lock();
        if let Some(&(addr, len)) = pieces.iter().find(|(a, l)| !holds(&ranges, *a, *l)) {
            return Err(std::io::Error::other(SysError::Unregistered { addr, len }));
        }
        // SAFETY: every piece is registered (checked under the lock, held
        // until the write returns); writers of it are the caller's protocol.
        let sent = unsafe {
            crate::vectored::try_write_spans(socket, head, pieces.iter().copied(), pieces.len() + 1)
        };
        drop(ranges);
        sent
    }

    /// Reads from `socket` into the registered `pieces` (address, length)
    /// without blocking (see `vectored::try_read_spans`).
    pub fn try_read_vectored(
        &self,
        socket: &tokio::net::TcpStream,
        pieces: &[(u64, u64)],
    ) -> std::io::Result<usize> {
        let ranges = self.read_lock();
        if let Some(&(addr, len)) = pieces
            .iter()
            .find(|(a, l)| !holds_writable(&ranges, *a, *l))
        {
            return Err(std::io::Error::other(SysError::Unregistered { addr, len }));
        }
        // SAFETY: every piece is registered writable (checked under the
        // lock, held until the read returns); other accesses are the
        // caller's protocol.
        let read = unsafe { crate::vectored::try_read_spans(socket, pieces.iter().copied()) };
        drop(ranges);
        read
    }

    pub(crate) fn read_lock(&self) -> RwLockReadGuard<'_, Vec<Registered>> {
        self.ranges.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The read lock, once every span's source and destination are inside
    /// registered ranges and do not overlap each other.
    pub(crate) fn checked(
        &self,
        spans: impl IntoIterator<Item = ByteSpan>,
    ) -> Result<RwLockReadGuard<'_, Vec<Registered>>> {
        self.checked_into(spans, |_, _| false)
    }

    /// As [`Self::checked`], with destinations `also(dst, len)` accepts
    /// allowed beside registered ones.
    pub(crate) fn checked_into(
        &self,
        spans: impl IntoIterator<Item = ByteSpan>,
        also: impl Fn(u64, u64) -> bool,
    ) -> Result<RwLockReadGuard<'_, Vec<Registered>>> {
        let ranges = self.read_lock();
        for span in spans {
            let (src_ok, dst_ok) = (
                holds(&ranges, span.src, span.len),
                holds_writable(&ranges, span.dst, span.len) || also(span.dst, span.len),
            );
            for (addr, ok) in [(span.src, src_ok), (span.dst, dst_ok)] {
                if !ok {
                    return Err(SysError::Unregistered {
                        addr,
                        len: span.len,
                    });
                }
            }
            let apart = span.src.saturating_add(span.len) <= span.dst
                || span.dst.saturating_add(span.len) <= span.src;
            if !apart && span.len > 0 {
                return Err(SysError::Overlap);
            }
        }
        Ok(ranges)
    }
}

/// The one of `ranges` (sorted, disjoint) that `addr..addr + len` lies in.
fn holding(ranges: &[Registered], addr: u64, len: u64) -> Option<&Registered> {
    let end = addr.checked_add(len)?;
    let at = ranges.partition_point(|r| r.start <= addr);
    ranges.get(at.checked_sub(1)?).filter(|r| end <= r.end)
}

/// Whether `addr..addr + len` lies inside one of `ranges`.
pub(crate) fn holds(ranges: &[Registered], addr: u64, len: u64) -> bool {
    holding(ranges, addr, len).is_some()
}

/// Whether `addr..addr + len` lies inside one of `ranges` that copies may
/// write.
pub(crate) fn holds_writable(ranges: &[Registered], addr: u64, len: u64) -> bool {
    holding(ranges, addr, len).is_some_and(|r| r.writable)
}

#[cfg(test)]
mod tests;
