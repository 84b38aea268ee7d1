//! Loads and stores of memory another process may be using at the same
//! moment (doorbell slots, mailboxes, route records): volatile byte copies
//! (no reference into the memory is ever formed) and a seqlock's sequence
//! word, with the fences that order them.

use std::sync::atomic::{AtomicU64, Ordering};

/// Reads `out.len()` bytes at `offset` of `region`, which another process
/// may be writing at the same moment (a doorbell's slots): volatile byte
/// loads, no reference into the memory, then an acquire fence (whatever the
/// writer published before these bytes is visible after). `false`, reading
/// nothing, when the range is not inside `region`.
pub fn read_shared(region: &kvcr_ucx::Registration<'_>, offset: usize, out: &mut [u8]) -> bool {
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
pub(crate) unsafe fn load_shared_bytes(src: *const u8, out: &mut [u8]) {
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
pub(crate) unsafe fn store_shared_bytes(dst: *mut u8, bytes: &[u8]) {
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
pub fn publish_shared(region: &kvcr_ucx::Registration<'_>, offset: usize, body: &[u8]) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
