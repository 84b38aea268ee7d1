//! Write message parts: how a write's bytes are cut into parts, which part
//! a message carries, how a part maps onto the write's spans, and which
//! parts of an operation have landed. Sans-I/O.

/// Which part of a write's bytes a write message carries: the bytes of
/// the keys it completes, cut into `count` pieces of equal length (the last
/// shorter), in order; `index` is the piece. A write of one part is a
/// whole-write message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    index: u8,
    /// 1..=[`Part::MAX_COUNT`].
    count: u16,
}

impl Part {
    /// Most parts one write is cut into (the count travels in a byte).
    pub(crate) const MAX_COUNT: u16 = 256;
    /// A whole write.
    #[cfg(test)]
    pub(crate) const WHOLE: Part = Part { index: 0, count: 1 };

    /// Part `index` of `count`, if `index < count <= MAX_COUNT`.
    pub(crate) fn new(index: u16, count: u16) -> Option<Self> {
        (index < count && count <= Self::MAX_COUNT).then_some(Self {
            index: u8::try_from(index).ok()?,
            count,
        })
    }

    pub(crate) fn index(self) -> u16 {
        u16::from(self.index)
    }

    pub(crate) fn count(self) -> u16 {
        self.count
    }

    /// The parts `total` bytes are cut into, at most `part_bytes` each, if
    /// that is at most [`Part::MAX_COUNT`] (one part when `total` is 0).
    pub(crate) fn cut(total: u64, part_bytes: u64) -> Option<u16> {
        let count = total.div_ceil(part_bytes.max(1)).max(1);
        u16::try_from(count).ok().filter(|c| *c <= Self::MAX_COUNT)
    }

    /// This part's byte range of a write of `total` bytes; `None` when the
    /// cut leaves it empty (a part that cannot exist).
    pub(crate) fn range(self, total: u64) -> Option<std::ops::Range<u64>> {
        let piece = total.div_ceil(u64::from(self.count));
        let start = piece.checked_mul(u64::from(self.index))?;
        let end = start.saturating_add(piece).min(total);
        match self.count {
            1 => Some(0..total),
            _ => (start < end).then_some(start..end),
        }
    }

    /// The wire form: index, then count − 1 (zeros are a whole write, as
    /// before writes were cut), then a zero byte.
    pub(super) fn to_bytes(self) -> [u8; 3] {
        // `count` is 1..=256, so count − 1 fits a byte.
        [self.index, (self.count - 1) as u8, 0]
    }

    pub(super) fn from_bytes(bytes: [u8; 3]) -> Option<Self> {
        if bytes[2] != 0 {
            return None;
        }
        Self::new(u16::from(bytes[0]), u16::from(bytes[1]) + 1)
    }
}

/// Which parts of an operation's write message have landed: the first one
/// fixes the key count and the cut, every later one must match them.
pub(crate) struct LandedParts {
    pub(super) keys: u32,
    pub(super) count: u16,
    pub(super) landed: [u64; 4],
}

const _: () = assert!(Part::MAX_COUNT as usize <= 4 * 64);

impl LandedParts {
    /// The word and bit of `part` in `landed` (the index is below 256).
    fn position(part: Part) -> (usize, u64) {
        let index = usize::from(part.index());
        (index / 64, 1 << (index % 64))
    }

    pub(super) fn has(&self, part: Part) -> bool {
        let (word, bit) = Self::position(part);
        self.landed.get(word).is_some_and(|w| w & bit != 0)
    }

    pub(super) fn mark(&mut self, part: Part) {
        let (word, bit) = Self::position(part);
        if let Some(w) = self.landed.get_mut(word) {
            *w |= bit;
        }
    }
}

/// How a verified write message's part fits what has landed of its
/// operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartFit {
    /// Its bytes may be copied; the operation then has every part.
    Last,
    /// Its bytes may be copied; more parts are to come.
    More,
    /// Already landed, or cut differently from the operation's first part
    /// (a replay, or a source that lies): its bytes are never copied.
    Refused,
}

/// The pieces of `spans` (start, length; laid end to end) that bytes
/// `range` of them cover, in order: how a write message's part maps onto
/// the write's spans, on both sides. Bytes past the spans' end are left
/// out.
pub(crate) fn spans_in_range(spans: &[(u64, u64)], range: std::ops::Range<u64>) -> Vec<(u64, u64)> {
    let mut pieces = Vec::new();
    let mut at = 0u64;
    for &(start, len) in spans {
        let (from, to) = (range.start.max(at), range.end.min(at.saturating_add(len)));
        if from < to {
            pieces.push((start + (from - at), to - from));
        }
        at = at.saturating_add(len);
        if at >= range.end {
            break;
        }
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rstest::rstest;

    /// A part's wire bytes (after the version): its index, its count − 1, a
    /// zero; all zeros are a whole write, as headers were before writes
    /// were cut. Anything else does not open.
    #[rstest]
    #[case::whole([0, 0, 0], Some((0, 1)))]
    #[case::second_of_three([1, 2, 0], Some((1, 3)))]
    #[case::last_of_most([255, 255, 0], Some((255, 256)))]
    #[case::index_past_count([2, 1, 0], None)]
    #[case::nonzero_pad([0, 0, 1], None)]
    fn a_part_travels_as_index_count_and_a_zero(
        #[case] bytes: [u8; 3],
        #[case] part: Option<(u16, u16)>,
    ) {
        let decoded = Part::from_bytes(bytes);
        assert_eq!(decoded.map(|p| (p.index(), p.count())), part);
        if let Some(p) = decoded {
            assert_eq!(p.to_bytes(), bytes);
        }
    }

    /// Bytes `range` of spans laid end to end, as pieces of those spans.
    #[rstest]
    #[case::inside_one(0..10, vec![(1000, 10)])]
    #[case::across_a_seam(90..110, vec![(1090, 10), (5000, 10)])]
    #[case::a_whole_span(100..150, vec![(5000, 50)])]
    #[case::all(0..160, vec![(1000, 100), (5000, 50), (9000, 10)])]
    #[case::past_the_end(155..400, vec![(9005, 5)])]
    #[case::empty(20..20, vec![])]
    fn a_byte_range_maps_onto_the_spans_it_covers(
        #[case] range: std::ops::Range<u64>,
        #[case] pieces: Vec<(u64, u64)>,
    ) {
        let spans = [(1000, 100), (5000, 50), (9000, 10)];
        assert_eq!(spans_in_range(&spans, range), pieces);
    }

    proptest! {
        /// A write cut into parts of at most `part_bytes`: the parts tile
        /// its bytes in order, none empty (a write of no bytes is one empty
        /// part), none longer than asked; a write needing more than
        /// `Part::MAX_COUNT` parts is not cut at all.
        #[test]
        fn parts_tile_their_write(total in 0u64..1 << 32, part_bytes in 1u64..1 << 22) {
            let Some(count) = Part::cut(total, part_bytes) else {
                prop_assert!(total.div_ceil(part_bytes) > u64::from(Part::MAX_COUNT));
                return Ok(());
            };
            let mut at = 0;
            for index in 0..count {
                let range = Part::new(index, count).unwrap().range(total).unwrap();
                prop_assert_eq!(range.start, at);
                prop_assert!(range.end > range.start || total == 0);
                prop_assert!(range.end - range.start <= part_bytes);
                at = range.end;
            }
            prop_assert_eq!(at, total);
            prop_assert_eq!(Part::new(count, count), None);
        }
    }
}
