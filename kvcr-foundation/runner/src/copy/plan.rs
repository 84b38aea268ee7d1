//! Copy plans: cutting a list of spans at byte boundaries, how many
//! threads a large copy may take, and the pages' digests taken on that many.
//! Shared by the copy thread ([`super`]), the peer write lanes
//! ([`super::lanes`]) and the peer thread's landing check, none of which
//! imports another for them.

use kvcr_runner_core::CopySpan;

/// The lanes' default count: one per core, at most 8 (12 threads reach the
/// H200 host's copy limit; 8 are within 80 % of it). A large local copy job
/// takes at most as many threads.
pub(crate) fn default_lanes() -> usize {
    cores().clamp(1, 8)
}

/// The CPUs this process may run on (1 when unknown).
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// Each page's digest (`None`: no page, or not registered in `memory`), its
/// spans (address, length) in layout order, on up to `threads` threads
/// when the pages add up to `split_bytes` or more: a page is hashed on one
/// thread (xxh3 is sequential), so pages are shared out among them.
pub(crate) fn page_digests(
    memory: &kvcr_sys::MemoryRegistry,
    pages: &[Option<&[(u64, u64)]>],
    split_bytes: u64,
    threads: usize,
) -> Vec<Option<u64>> {
    let one = |spans: &Option<&[(u64, u64)]>| memory.digest((*spans)?).ok();
    let total: u64 = pages
        .iter()
        .flatten()
        .flat_map(|s| s.iter())
        .map(|s| s.1)
        .sum();
    let threads = threads.min(pages.len());
    if total < split_bytes || threads < 2 {
        return pages.iter().map(one).collect();
    }
    let chunk = pages.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let parts: Vec<_> = pages
            .chunks(chunk)
            .map(|part| scope.spawn(move || part.iter().map(one).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .zip(pages.chunks(chunk))
            // A thread that died hashed nothing we can trust: its pages get
            // no digest, never a wrong one.
            .flat_map(|(part, pages)| part.join().unwrap_or_else(|_| vec![None; pages.len()]))
            .collect()
    })
}

/// Performs the copies of `spans` through `memory`, which checks every span
/// against what is registered there (one read lock for the call).
pub(crate) fn copy_checked(
    memory: &kvcr_sys::MemoryRegistry,
    spans: &[CopySpan],
    stream: bool,
) -> kvcr_sys::Result<()> {
    let spans = spans.iter().map(byte_span);
    if stream {
        memory.copy_streaming(spans)
    } else {
        memory.copy(spans)
    }
}

/// The span as the registry names it.
pub(crate) fn byte_span(span: &CopySpan) -> kvcr_sys::ByteSpan {
    kvcr_sys::ByteSpan::new(span.src, span.dst, span.len)
}

/// Whether no two destination ranges among `spans` overlap.
pub(crate) fn spans_disjoint<'a>(spans: impl Iterator<Item = &'a CopySpan>) -> bool {
    let mut ranges: Vec<(u64, u64)> = spans
        .map(|s| (s.dst, s.dst.saturating_add(s.len)))
        .collect();
    ranges.sort_unstable();
    ranges.windows(2).all(|w| matches!(w, [a, b] if a.1 <= b.0))
}

/// Cuts `spans` at `at` bytes: the first part moves exactly the first `at`
/// bytes (in order), the second the rest (a span may be cut in two).
pub(crate) fn cut(spans: &[CopySpan], at: u64) -> (Vec<CopySpan>, Vec<CopySpan>) {
    let (mut first, mut second) = (Vec::new(), Vec::new());
    let mut done = 0u64;
    for s in spans {
        if done >= at {
            second.push(*s);
        } else if done + s.len <= at {
            first.push(*s);
        } else {
            let head = at - done;
            first.push(CopySpan { len: head, ..*s });
            second.push(CopySpan {
                src: s.src + head,
                dst: s.dst + head,
                len: s.len - head,
            });
        }
        done += s.len;
    }
    (first, second)
}

/// Cuts `copies` (`total` bytes) into `parts` pieces of near-equal bytes.
pub(crate) fn split_even(copies: Vec<CopySpan>, total: u64, parts: u64) -> Vec<Vec<CopySpan>> {
    let mut out = Vec::new();
    let mut rest = copies;
    let mut left = total;
    for remaining_parts in (2..=parts).rev() {
        let (head, tail) = cut(&rest, left / remaining_parts);
        left -= head.iter().map(|s| s.len).sum::<u64>();
        out.push(head);
        rest = tail;
    }
    out.push(rest);
    out.retain(|p| !p.is_empty());
    out
}

/// Cuts `items` (in order) into at most `parts` runs of near-equal
/// `weight`, never splitting an item: each run ends at the first item that
/// reaches its share of the total (so no run is empty, and an item heavier
/// than a share takes a run of its own).
pub(crate) fn split_whole<T>(items: Vec<T>, weight: impl Fn(&T) -> u64, parts: u64) -> Vec<Vec<T>> {
    let total: u64 = items.iter().map(&weight).sum();
    let parts = parts.clamp(1, (items.len() as u64).max(1));
    let mut out: Vec<Vec<T>> = Vec::new();
    let mut run = Vec::new();
    let mut done = 0u64;
    for item in items {
        done += weight(&item);
        run.push(item);
        // The end of run `k` (0-based) is where the weight so far reaches
        // `(k + 1) / parts` of the total.
        let k = out.len() as u64;
        if k + 1 < parts
            && u128::from(done) * u128::from(parts) >= u128::from(total) * u128::from(k + 1)
        {
            out.push(std::mem::take(&mut run));
        }
    }
    if !run.is_empty() {
        out.push(run);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(src: u64, dst: u64, len: u64) -> CopySpan {
        CopySpan { src, dst, len }
    }

    #[test]
    fn even_split_moves_every_byte_once_in_order() {
        let copies = vec![c(0, 1000, 10), c(100, 2000, 7), c(200, 3000, 13)];
        for parts in 1..=8 {
            let pieces = split_even(copies.clone(), 30, parts);
            assert!(pieces.len() as u64 <= parts);
            let flat: Vec<CopySpan> = pieces.concat();
            let bytes: Vec<(u64, u64)> = flat
                .iter()
                .flat_map(|s| (0..s.len).map(move |i| (s.src + i, s.dst + i)))
                .collect();
            let expected: Vec<(u64, u64)> = copies
                .iter()
                .flat_map(|s| (0..s.len).map(move |i| (s.src + i, s.dst + i)))
                .collect();
            assert_eq!(bytes, expected, "parts {parts}");
            let sizes: Vec<u64> = pieces
                .iter()
                .map(|p| p.iter().map(|s| s.len).sum())
                .collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "parts {parts}: {sizes:?}");
        }
    }

    #[test]
    fn whole_splits_keep_every_item_once_in_order_and_balance_them() {
        for (weights, parts, want) in [
            (vec![4u64, 4, 4, 4], 4, vec![1, 1, 1, 1]),
            (vec![4, 4, 4, 4], 2, vec![2, 2]),
            (vec![4, 4, 4, 4], 8, vec![1, 1, 1, 1]),
            (vec![16, 1, 1, 1, 1], 2, vec![1, 4]),
            (vec![1, 1, 1, 1, 16], 2, vec![5]),
            (vec![3], 4, vec![1]),
            (vec![], 3, vec![]),
        ] {
            let items: Vec<(usize, u64)> = weights.iter().copied().enumerate().collect();
            let runs = split_whole(items.clone(), |i| i.1, parts);
            let sizes: Vec<usize> = runs.iter().map(Vec::len).collect();
            assert_eq!(sizes, want, "{weights:?} in {parts}");
            assert_eq!(runs.concat(), items);
        }
    }

    #[test]
    fn cutting_keeps_every_byte_once_and_in_order() {
        let spans = [c(0, 100, 10), c(50, 200, 6)];
        let (a, b) = cut(&spans, 8);
        assert_eq!(a, vec![c(0, 100, 8)]);
        assert_eq!(b, vec![c(8, 108, 2), c(50, 200, 6)]);
        let (a, b) = cut(&spans, 10);
        assert_eq!((a.len(), b.len()), (1, 1));
    }
}
