//! Where a deliver entry's bytes go in framework memory, kept for the
//! operation's life.
//!
//! An engine grants a page one slot index across consecutive regions (a
//! layer-first pool: each layer's K and V a region). Such a page is kept as
//! that run, three numbers, and its spans are worked out when a copy needs
//! them: a restore of the seed's 1812 pages kept 128 spans each, 5.4 MiB of
//! fresh heap whose first touches were much of a fresh engine process's
//! first `deliver` (see BENCH-HISTORY, issue 42). Regions are never changed
//! once registered, and every element was resolved when the deliver was
//! accepted, so a run resolves later to the same spans.

use kvcr_contracts::protocol::{ElementRef, ElementRun};

use crate::region::RegionTable;

/// A deliver entry's destinations, in layout order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::machine) enum Destinations {
    /// Each element's span in framework memory: address and length.
    Spans(Vec<(u64, u64)>),
    /// The elements of one run: a slot index in consecutive regions.
    Run(ElementRun),
}

impl Default for Destinations {
    fn default() -> Self {
        Self::Spans(Vec::new())
    }
}

impl Destinations {
    /// `elements` as a run, if they are one ([`ElementRun::of`]).
    pub(in crate::machine) fn run_of(elements: &[ElementRef]) -> Option<Self> {
        ElementRun::of(elements).map(Self::Run)
    }

    /// The spans, address and length, in layout order; `None` for an
    /// element of a run that does not resolve (never, see the module doc:
    /// a caller fails the entry rather than copy part of it).
    pub(in crate::machine) fn spans<'a>(
        &'a self,
        regions: &'a RegionTable,
    ) -> impl Iterator<Item = Option<(u64, u64)>> + 'a {
        let (spans, run) = match self {
            Self::Spans(spans) => (spans.as_slice(), None),
            Self::Run(run) => (&[][..], Some(run.elements())),
        };
        let listed = spans.iter().map(|span| Some(*span));
        let resolved = run.into_iter().flatten().map(move |element| {
            regions
                .resolve(element)
                .ok()
                .map(|span| (span.addr, span.len))
        });
        listed.chain(resolved)
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;
    use kvcr_contracts::protocol::RegionId;
    use kvcr_contracts::tier::Owner;

    use crate::region::{RegionDesc, RegionMemory};
    use crate::tests::element;

    #[rstest]
    #[case::one_element(&[(3, 7)], Some((3, 1, 7)))]
    #[case::consecutive_regions_one_index(&[(0, 5), (1, 5), (2, 5)], Some((0, 3, 5)))]
    #[case::a_region_skipped(&[(0, 5), (2, 5)], None)]
    #[case::regions_descending(&[(1, 5), (0, 5)], None)]
    #[case::a_region_twice(&[(1, 5), (1, 5)], None)]
    #[case::two_indices(&[(0, 5), (1, 6)], None)]
    #[case::empty(&[], None)]
    fn a_run_is_consecutive_regions_at_one_index(
        #[case] elements: &[(u32, u64)],
        #[case] run: Option<(u32, u16, u64)>,
    ) {
        let elements: Vec<ElementRef> = elements.iter().map(|&(r, i)| element(r, i)).collect();
        let expected = run.map(|(first, count, index)| {
            Destinations::Run(ElementRun::new(RegionId(first), count, index).unwrap())
        });
        assert_eq!(Destinations::run_of(&elements), expected);
    }

    /// A run resolves to the spans its elements resolve to, one by one,
    /// and an element past its region resolves to `None`, not to a
    /// shorter list.
    #[test]
    fn a_run_resolves_as_its_elements_do() {
        let mut regions = RegionTable::default();
        let pools = [("k".to_owned(), 64), ("v".to_owned(), 128)];
        for (label, base, size) in [
            ("k:0", 0x10_000u64, 64u64),
            ("v:0", 0x40_000, 128),
            ("k:1", 0x90_000, 64),
        ] {
            let desc = RegionDesc {
                label: label.into(),
                base,
                size,
                stride: 0,
                count: 8,
            };
            regions
                .register(desc, Owner::Framework, RegionMemory::Device, &pools, None)
                .unwrap();
        }
        let run = Destinations::Run(ElementRun::new(RegionId(0), 3, 5).unwrap());
        let spans: Option<Vec<(u64, u64)>> = run.spans(&regions).collect();
        let expected: Vec<(u64, u64)> = (0..3)
            .map(|r| {
                let span = regions.resolve(element(r, 5)).unwrap();
                (span.addr, span.len)
            })
            .collect();
        assert_eq!(spans, Some(expected));
        assert_eq!(
            spans.unwrap(),
            [
                (0x10_000 + 5 * 64, 64),
                (0x40_000 + 5 * 128, 128),
                (0x90_000 + 5 * 64, 64)
            ]
        );
        let past = Destinations::Run(ElementRun::new(RegionId(1), 3, 5).unwrap());
        assert_eq!(past.spans(&regions).collect::<Option<Vec<_>>>(), None);
        let listed = Destinations::Spans(vec![(1, 2), (3, 4)]);
        assert_eq!(
            listed.spans(&regions).collect::<Option<Vec<_>>>(),
            Some(vec![(1, 2), (3, 4)])
        );
    }
}
