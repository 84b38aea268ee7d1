//! Row copies: one group of a job (one span index over every page) often
//! walks both sides with a constant stride, slot after slot: consecutive
//! KVCR DRAM slots (a whole page apart) into consecutive GPU slots of one
//! layer's buffer (one span apart). Such a run is a single 2D copy
//! (`cuMemcpy2DAsync`: rows of one width at a source and a destination
//! pitch) instead of one descriptor per page. The copy engines move it at
//! the same rate, and the CPU issues one call where it built thousands of
//! descriptors, which is the source's cost on the one-hop route.
//!
//! Pure planning, no CUDA: what is left over keeps the copier's mode.

/// A run of equally long spans, each `src_pitch` after the last in the
/// source and `dst_pitch` after it in the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rows {
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) src_pitch: u64,
    pub(crate) dst_pitch: u64,
    pub(crate) width: u64,
    pub(crate) height: u64,
}

/// Runs shorter than this stay single spans: a few descriptors cost less
/// than a 2D copy's set-up.
pub(crate) const MIN_ROWS: usize = 4;

/// Takes every run of at least [`MIN_ROWS`] spans out of `words` (triples
/// `src, dst, len`, in issue order) and returns them; `words` keeps the
/// spans no run took, in their order. A run's pitches are at least its
/// width (rows never overlap, in the source or the destination) and at most
/// `max_pitch` (the device's limit); a stride that runs backwards or wraps
/// ends a run.
pub(crate) fn take_rows(words: &mut Vec<u64>, max_pitch: u64) -> Vec<Rows> {
    let spans: Vec<[u64; 3]> = words
        .chunks_exact(3)
        .filter_map(|w| <[u64; 3]>::try_from(w).ok())
        .collect();
    let mut runs = Vec::new();
    let mut left = Vec::with_capacity(words.len());
    let mut rest = spans.as_slice();
    while let Some(first) = rest.first() {
        match run_from(rest, max_pitch) {
            Some(run) => {
                runs.push(run);
                rest = rest.get(run.height as usize..).unwrap_or_default();
            }
            None => {
                left.extend_from_slice(first);
                rest = rest.get(1..).unwrap_or_default();
            }
        }
    }
    *words = left;
    runs
}

/// The run that starts with the first span, if at least [`MIN_ROWS`] spans
/// continue it.
fn run_from(spans: &[[u64; 3]], max_pitch: u64) -> Option<Rows> {
    let pitch = |a: u64, b: u64, width: u64| {
        b.checked_sub(a)
            .filter(|&p| p >= width && p <= max_pitch && p > 0)
    };
    let (&[src, dst, width], &[next_src, next_dst, next_width]) = (spans.first()?, spans.get(1)?);
    let src_pitch = pitch(src, next_src, width)?;
    let dst_pitch = pitch(dst, next_dst, width)?;
    if next_width != width || width == 0 {
        return None;
    }
    let continues = |(prev, next): (&[u64; 3], &[u64; 3])| {
        let (&[prev_src, prev_dst, _], &[s, d, w]) = (prev, next);
        w == width
            && s.checked_sub(prev_src) == Some(src_pitch)
            && d.checked_sub(prev_dst) == Some(dst_pitch)
    };
    let height = 1 + spans
        .iter()
        .zip(spans.iter().skip(1))
        .take_while(|&pair| continues(pair))
        .count();
    (height >= MIN_ROWS).then_some(Rows {
        src,
        dst,
        src_pitch,
        dst_pitch,
        width,
        height: height as u64,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rstest::rstest;

    use super::*;

    const MAX: u64 = (1 << 31) - 1;

    /// `n` spans of `width`, slot `first + i` on both sides.
    fn strided(first: u64, n: u64, src_pitch: u64, dst_pitch: u64, width: u64) -> Vec<u64> {
        (first..first + n)
            .flat_map(|i| {
                [
                    0x1000_0000 + i * src_pitch,
                    0x9000_0000 + i * dst_pitch,
                    width,
                ]
            })
            .collect()
    }

    /// Every byte the plan moves, as (src, dst) pairs: the same set before
    /// and after taking rows.
    fn moved(words: &[u64], rows: &[Rows]) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = words
            .chunks_exact(3)
            .flat_map(|w| (0..w[2]).map(move |b| (w[0] + b, w[1] + b)))
            .collect();
        for r in rows {
            for row in 0..r.height {
                for b in 0..r.width {
                    out.push((r.src + row * r.src_pitch + b, r.dst + row * r.dst_pitch + b));
                }
            }
        }
        out.sort_unstable();
        out
    }

    #[rstest]
    #[case::one_run(strided(0, 8, 64, 16, 16), 1, 0)]
    #[case::too_short(strided(0, 3, 64, 16, 16), 0, 3)]
    #[case::contiguous_both_sides(strided(0, 6, 16, 16, 16), 1, 0)]
    #[case::overlapping_source_rows(strided(0, 6, 8, 16, 16), 0, 6)]
    #[case::pitch_over_the_limit(strided(0, 6, MAX + 1, 16, 16), 0, 6)]
    #[case::two_runs([strided(0, 5, 64, 16, 16), strided(100, 4, 64, 16, 16)].concat(), 2, 0)]
    #[case::run_then_strays([strided(0, 4, 64, 16, 16), strided(50, 1, 64, 16, 16),
        strided(9, 1, 64, 16, 16)].concat(), 1, 2)]
    #[case::backwards(strided(0, 6, 64, 16, 16).chunks_exact(3).rev().flatten().copied()
        .collect(), 0, 6)]
    #[case::width_changes({ let mut w = strided(0, 6, 64, 16, 16); w[3 * 3 + 2] = 8; w }, 0, 6)]
    #[case::empty(Vec::new(), 0, 0)]
    fn runs_of_equal_strides_become_rows(
        #[case] words: Vec<u64>,
        #[case] runs: usize,
        #[case] left: usize,
    ) {
        let before = moved(&words, &[]);
        let mut after = words.clone();
        let rows = take_rows(&mut after, MAX);
        assert_eq!(rows.len(), runs, "{rows:?}");
        assert_eq!(after.len() / 3, left);
        assert_eq!(
            moved(&after, &rows),
            before,
            "the plan moves the same bytes"
        );
        for r in &rows {
            assert!(r.height as usize >= MIN_ROWS);
            assert!(r.src_pitch >= r.width && r.dst_pitch >= r.width);
        }
    }

    /// Spans from pieces: a strided run (first slot, length, pitches,
    /// width) or a lone span, in any order and overlap; no span twice (so
    /// each leftover has one place in the input).
    fn pieces() -> impl Strategy<Value = Vec<u64>> {
        let piece = (0u64..64, 1u64..9, 1u64..40, 1u64..40, 1u64..6);
        proptest::collection::vec(piece, 0..12).prop_map(|pieces| {
            let mut seen = std::collections::HashSet::new();
            pieces
                .into_iter()
                .flat_map(|(first, n, sp, dp, width)| strided(first, n, sp, dp, width))
                .collect::<Vec<u64>>()
                .chunks_exact(3)
                .filter(|span| seen.insert(span.to_vec()))
                .flatten()
                .copied()
                .collect()
        })
    }

    proptest! {
        /// Whatever the spans: the plan moves exactly their bytes, every
        /// run is legal, the leftovers keep their order, and no leftover
        /// could have started a run (the planner is greedy, not lazy).
        #[test]
        fn a_plan_moves_the_same_bytes_in_legal_runs(words in pieces(), max in 1u64..64) {
            let mut left = words.clone();
            let rows = take_rows(&mut left, max);
            prop_assert_eq!(moved(&left, &rows), moved(&words, &[]));
            for r in &rows {
                prop_assert!(r.height as usize >= MIN_ROWS);
                prop_assert!(r.src_pitch >= r.width && r.dst_pitch >= r.width);
                prop_assert!(r.src_pitch <= max && r.dst_pitch <= max);
            }
            let spans: Vec<[u64; 3]> = words
                .chunks_exact(3)
                .map(|w| [w[0], w[1], w[2]])
                .collect();
            let mut from = 0;
            for lone in left.chunks_exact(3) {
                let at = spans[from..]
                    .iter()
                    .position(|s| s[..] == *lone)
                    .map(|i| from + i);
                prop_assert!(at.is_some(), "leftovers out of order");
                let at = at.unwrap_or_default();
                prop_assert!(run_from(&spans[at..], max).is_none());
                from = at + 1;
            }
        }
    }

    #[test]
    fn leftovers_keep_their_order() {
        let mut words = [
            strided(7, 1, 64, 16, 16),
            strided(0, 4, 64, 16, 16),
            strided(3, 1, 64, 16, 16),
        ]
        .concat();
        let first = words[..3].to_vec();
        let last = words[15..].to_vec();
        let rows = take_rows(&mut words, MAX);
        assert_eq!(rows.len(), 1);
        assert_eq!(words, [first, last].concat());
    }
}
