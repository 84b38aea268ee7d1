//! The fast path's copies: a plan's transfers as raw memory copies between
//! addresses the caller has resolved and bounds-checked.
//!
//! Unsafe, named: the only place this crate writes memory. A plan of
//! [`SPLIT_BYTES`] or more whose destinations are pairwise disjoint is cut
//! at its byte midpoint (a transfer may be cut in two) and copied by two
//! threads, as the runner's copy engine does: one thread copies ~10 GB/s
//! here, two draw more of the memory bandwidth.

/// Plans at least this large are copied by two threads.
pub(crate) const SPLIT_BYTES: u64 = 8 << 20;

/// One resolved copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawCopy {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) len: u64,
}

/// Whether no two destination ranges overlap.
fn destinations_disjoint(copies: &[RawCopy]) -> bool {
    let mut ranges: Vec<(u64, u64)> = copies
        .iter()
        .map(|c| (c.dst, c.dst.saturating_add(c.len)))
        .collect();
    ranges.sort_unstable();
    ranges.windows(2).all(|w| matches!(w, [a, b] if a.1 <= b.0))
}

/// Cuts `copies` at `at` bytes: the first part moves exactly the first `at`
/// bytes (in order), the second the rest.
fn cut(copies: &[RawCopy], at: u64) -> (Vec<RawCopy>, Vec<RawCopy>) {
    let (mut first, mut second) = (Vec::new(), Vec::new());
    let mut done = 0u64;
    for c in copies {
        if done >= at {
            second.push(*c);
        } else if done + c.len <= at {
            first.push(*c);
        } else {
            let head = at - done;
            first.push(RawCopy { len: head, ..*c });
            second.push(RawCopy {
                src: c.src + head,
                dst: c.dst + head,
                len: c.len - head,
            });
        }
        done += c.len;
    }
    (first, second)
}

/// Performs the copies in order.
///
/// # Safety
/// Every `src..src+len` must be valid for reads and every `dst..dst+len`
/// valid for writes for the whole call; no other thread may write a source
/// or access a destination during the call; no source overlaps a
/// destination.
unsafe fn copy_sequential(copies: &[RawCopy]) {
    for c in copies {
        // SAFETY: this function's contract.
        unsafe {
            std::ptr::copy_nonoverlapping(
                c.src as usize as *const u8,
                c.dst as usize as *mut u8,
                c.len as usize,
            );
        }
    }
}

/// Performs the copies (on two threads when large and disjoint).
///
/// # Safety
/// As `copy_sequential`: every range valid for the whole call, nothing else
/// touching a destination or writing a source, no source overlapping a
/// destination.
pub(crate) unsafe fn copy_all(copies: &[RawCopy]) {
    let total: u64 = copies.iter().map(|c| c.len).sum();
    if total < SPLIT_BYTES || !destinations_disjoint(copies) {
        // SAFETY: this function's contract.
        unsafe { copy_sequential(copies) };
        return;
    }
    let (first, second) = cut(copies, total / 2);
    // The two halves write disjoint bytes (destinations are pairwise
    // disjoint, and a cut transfer's halves are disjoint ranges); the scope
    // joins the helper before this returns, inside the contract's window.
    std::thread::scope(|scope| {
        // SAFETY: the contract, over a subset of the ranges; disjoint from
        // what this thread writes (above).
        let helper = scope.spawn(|| unsafe { copy_sequential(&second) });
        // SAFETY: as above.
        unsafe { copy_sequential(&first) };
        if helper.join().is_err() {
            // A raw copy of validated ranges cannot panic; if the helper
            // died anyway, copy its half here so the result stays whole.
            // SAFETY: as above; the helper has ended.
            unsafe { copy_sequential(&second) };
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(src: u64, dst: u64, len: u64) -> RawCopy {
        RawCopy { src, dst, len }
    }

    #[test]
    fn cutting_keeps_every_byte_once_and_in_order() {
        let copies = [c(0, 100, 10), c(50, 200, 6)];
        let (a, b) = cut(&copies, 8);
        assert_eq!(a, vec![c(0, 100, 8)]);
        assert_eq!(b, vec![c(8, 108, 2), c(50, 200, 6)]);
        let (a, b) = cut(&copies, 10);
        assert_eq!((a.len(), b.len()), (1, 1));
    }

    #[test]
    fn overlapping_destinations_are_detected() {
        assert!(destinations_disjoint(&[c(0, 0, 4), c(0, 4, 4)]));
        assert!(!destinations_disjoint(&[c(0, 0, 5), c(0, 4, 4)]));
    }

    #[test]
    fn a_large_plan_copied_on_two_threads_matches() {
        let len = (SPLIT_BYTES + 12_345) as usize;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; len];
        let (s, d) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
        // Three pieces, the middle one reversed in placement.
        let third = (len / 3) as u64;
        let copies = [
            c(s, d + 2 * third, len as u64 - 2 * third),
            c(s + (len as u64 - 2 * third), d, third),
            c(s + (len as u64 - third), d + third, third),
        ];
        // SAFETY: (test) all ranges lie inside `src` / `dst`, which outlive
        // the call and are not otherwise touched; they do not overlap.
        unsafe { copy_all(&copies) };
        let mut expect = vec![0u8; len];
        for k in copies {
            let (so, dof) = ((k.src - s) as usize, (k.dst - d) as usize);
            expect[dof..dof + k.len as usize].copy_from_slice(&src[so..so + k.len as usize]);
        }
        assert_eq!(dst, expect);
    }
}
