//! A key's granted elements as the wire carries them: runs of consecutive
//! regions at one index.
//!
//! A layer-first engine grants each page one slot index across its layers'
//! regions, so a page's 128 elements are one run. Kept as runs, a
//! `start_write` is decoded, checked and planned without first being
//! expanded into one [`ElementRef`] per element (on an H100 host's source
//! that expansion and its allocations were a sixth of a write's handling).

use std::fmt;

use super::{ElementRef, RegionId};

/// Elements `first ..= first + regions - 1`, each at `index`: never empty,
/// and its last region fits `u32`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ElementRun {
    first: RegionId,
    regions: u16,
    index: u64,
}

impl ElementRun {
    /// The run of `regions` consecutive regions from `first`, each at
    /// `index`; `None` when it would be empty or run past region
    /// `u32::MAX`.
    pub fn new(first: RegionId, regions: u16, index: u64) -> Option<Self> {
        first.0.checked_add(u32::from(regions).checked_sub(1)?)?;
        Some(Self {
            first,
            regions,
            index,
        })
    }

    /// The one run `elements` are, if they are one: at least one element,
    /// each in the region after the one before, all at one index, no more
    /// than a run holds (`u16::MAX`).
    pub fn of(elements: &[ElementRef]) -> Option<Self> {
        let first = elements.first()?;
        let in_run = elements.iter().zip(0u32..).all(|(e, i)| {
            e.index == first.index && first.region.0.checked_add(i) == Some(e.region.0)
        });
        let regions = u16::try_from(elements.len()).ok()?;
        in_run
            .then(|| Self::new(first.region, regions, first.index))
            .flatten()
    }

    /// The first region.
    pub fn first(&self) -> RegionId {
        self.first
    }

    /// How many regions (at least one).
    pub fn regions(&self) -> u16 {
        self.regions
    }

    /// The element index in each region.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// How many elements (as `regions`).
    pub fn len(&self) -> usize {
        usize::from(self.regions)
    }

    /// Never: a run holds at least one element.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Its elements, in region order.
    pub fn elements(&self) -> impl ExactSizeIterator<Item = ElementRef> + Clone + use<> {
        let (first, index) = (self.first.0, self.index);
        // `new` checked that the last region fits `u32`.
        (0..u32::from(self.regions)).map(move |i| ElementRef {
            region: RegionId(first + i),
            index,
        })
    }

    /// The run one element longer, when `element` is the next region at
    /// the same index and the run is not at its longest.
    fn extended_by(self, element: ElementRef) -> Option<Self> {
        let next = self.first.0.checked_add(u32::from(self.regions))?;
        let regions = self.regions.checked_add(1)?;
        (element.index == self.index && element.region.0 == next)
            .then_some(Self { regions, ..self })
    }
}

impl fmt::Debug for ElementRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let last = self.first.0 + (u32::from(self.regions) - 1);
        write!(f, "r{}..=r{}@{}", self.first.0, last, self.index)
    }
}

/// One key's granted elements, in order, as runs ([`ElementRun`]): one run
/// is held inline, more in a vector. Two are equal when they name the same
/// elements in the same order, however they are cut into runs.
#[derive(Clone, Default)]
pub struct ElementRuns {
    runs: Runs,
    /// Elements over all runs.
    len: usize,
}

#[derive(Clone)]
enum Runs {
    One(ElementRun),
    /// None, or more than one.
    Many(Vec<ElementRun>),
}

impl Default for Runs {
    fn default() -> Self {
        Self::Many(Vec::new())
    }
}

impl ElementRuns {
    /// No elements.
    pub fn new() -> Self {
        Self::default()
    }

    /// The elements of one run.
    pub fn from_run(run: ElementRun) -> Self {
        Self {
            runs: Runs::One(run),
            len: run.len(),
        }
    }

    /// `elements`, in order, cut into the longest runs.
    pub fn from_elements(elements: &[ElementRef]) -> Self {
        elements.iter().copied().collect()
    }

    /// Appends `element`: it extends the last run when it is that run's
    /// next region at the same index, else starts a run of its own.
    pub fn push(&mut self, element: ElementRef) {
        let last = match &mut self.runs {
            Runs::One(run) => Some(run),
            Runs::Many(runs) => runs.last_mut(),
        };
        if let Some(last) = last
            && let Some(longer) = last.extended_by(element)
        {
            *last = longer;
            self.len += 1;
            return;
        }
        self.push_run(ElementRun {
            first: element.region,
            regions: 1,
            index: element.index,
        });
    }

    /// Appends `run` as it is (not merged with the last).
    pub fn push_run(&mut self, run: ElementRun) {
        self.len += run.len();
        match &mut self.runs {
            Runs::One(last) => self.runs = Runs::Many(vec![*last, run]),
            Runs::Many(runs) if runs.is_empty() => self.runs = Runs::One(run),
            Runs::Many(runs) => runs.push(run),
        }
    }

    /// The runs, in order.
    pub fn runs(&self) -> &[ElementRun] {
        match &self.runs {
            Runs::One(run) => std::slice::from_ref(run),
            Runs::Many(runs) => runs,
        }
    }

    /// How many elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first element.
    pub fn first(&self) -> Option<ElementRef> {
        self.runs().first().and_then(|run| run.elements().next())
    }

    /// The elements, in order.
    pub fn iter(&self) -> Elements<'_> {
        Elements {
            runs: self.runs().iter(),
            run: None,
            left: self.len,
        }
    }

    /// The elements, in order, one by one.
    pub fn to_vec(&self) -> Vec<ElementRef> {
        self.iter().collect()
    }
}

/// [`ElementRuns`]' elements, in order.
#[derive(Clone)]
pub struct Elements<'a> {
    runs: std::slice::Iter<'a, ElementRun>,
    /// The run under way and how many of its elements were taken.
    run: Option<(ElementRun, u32)>,
    /// Elements not yet taken.
    left: usize,
}

impl Iterator for Elements<'_> {
    type Item = ElementRef;

    fn next(&mut self) -> Option<ElementRef> {
        loop {
            if let Some((run, taken)) = &mut self.run
                && *taken < u32::from(run.regions)
            {
                // `ElementRun::new` checked that the last region fits `u32`.
                let element = ElementRef {
                    region: RegionId(run.first.0 + *taken),
                    index: run.index,
                };
                *taken += 1;
                self.left = self.left.saturating_sub(1);
                return Some(element);
            }
            self.run = Some((*self.runs.next()?, 0));
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Elements<'_> {}

impl<'a> IntoIterator for &'a ElementRuns {
    type Item = ElementRef;
    type IntoIter = Elements<'a>;

    fn into_iter(self) -> Elements<'a> {
        self.iter()
    }
}

impl FromIterator<ElementRef> for ElementRuns {
    fn from_iter<I: IntoIterator<Item = ElementRef>>(elements: I) -> Self {
        let mut runs = Self::new();
        for element in elements {
            runs.push(element);
        }
        runs
    }
}

impl From<Vec<ElementRef>> for ElementRuns {
    fn from(elements: Vec<ElementRef>) -> Self {
        Self::from_elements(&elements)
    }
}

impl From<&[ElementRef]> for ElementRuns {
    fn from(elements: &[ElementRef]) -> Self {
        Self::from_elements(elements)
    }
}

impl PartialEq for ElementRuns {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl Eq for ElementRuns {}

impl fmt::Debug for ElementRuns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.runs()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rstest::rstest;

    fn e(region: u32, index: u64) -> ElementRef {
        ElementRef {
            region: RegionId(region),
            index,
        }
    }

    #[rstest]
    #[case::one_run(vec![e(3, 7), e(4, 7), e(5, 7)], vec![(3, 3, 7)])]
    #[case::index_changes(vec![e(3, 7), e(4, 8)], vec![(3, 1, 7), (4, 1, 8)])]
    #[case::region_skips(vec![e(3, 7), e(5, 7), e(6, 7)], vec![(3, 1, 7), (5, 2, 7)])]
    #[case::region_repeats(vec![e(3, 7), e(3, 7)], vec![(3, 1, 7), (3, 1, 7)])]
    #[case::regions_descend(vec![e(4, 7), e(3, 7)], vec![(4, 1, 7), (3, 1, 7)])]
    #[case::last_region(vec![e(u32::MAX - 1, 0), e(u32::MAX, 0)], vec![(u32::MAX - 1, 2, 0)])]
    #[case::none(vec![], vec![])]
    fn elements_are_cut_into_the_longest_runs(
        #[case] elements: Vec<ElementRef>,
        #[case] expected: Vec<(u32, u16, u64)>,
    ) {
        let runs = ElementRuns::from_elements(&elements);
        let got: Vec<_> = runs
            .runs()
            .iter()
            .map(|r| (r.first().0, r.regions(), r.index()))
            .collect();
        assert_eq!(got, expected);
        assert_eq!(runs.len(), elements.len());
        assert_eq!(runs.to_vec(), elements);
        assert_eq!(runs.first(), elements.first().copied());
    }

    #[test]
    fn a_run_stops_at_the_longest_the_wire_carries() {
        let elements: Vec<_> = (0..=u32::from(u16::MAX)).map(|r| e(r, 1)).collect();
        let runs = ElementRuns::from_elements(&elements);
        assert_eq!(runs.runs().len(), 2);
        assert_eq!(runs.runs()[0].regions(), u16::MAX);
        assert_eq!(runs.runs()[1].first(), RegionId(u32::from(u16::MAX)));
        assert_eq!(runs.len(), elements.len());
    }

    #[test]
    fn elements_are_one_run_only_up_to_the_longest_run() {
        let elements: Vec<_> = (0..=u32::from(u16::MAX)).map(|r| e(r, 1)).collect();
        let longest = ElementRun::of(&elements[..usize::from(u16::MAX)]);
        assert_eq!(longest, ElementRun::new(RegionId(0), u16::MAX, 1));
        assert_eq!(ElementRun::of(&elements), None);
    }

    #[rstest]
    #[case::empty(RegionId(0), 0)]
    #[case::past_the_last_region(RegionId(u32::MAX), 2)]
    fn a_run_that_cannot_be_is_refused(#[case] first: RegionId, #[case] regions: u16) {
        assert_eq!(ElementRun::new(first, regions, 0), None);
    }

    #[test]
    fn runs_cut_differently_are_equal_when_their_elements_are() {
        let whole = ElementRuns::from_run(ElementRun::new(RegionId(2), 4, 9).unwrap());
        let mut cut = ElementRuns::new();
        cut.push_run(ElementRun::new(RegionId(2), 1, 9).unwrap());
        cut.push_run(ElementRun::new(RegionId(3), 3, 9).unwrap());
        assert_eq!(whole, cut);
        let mut other = ElementRuns::new();
        other.push_run(ElementRun::new(RegionId(2), 4, 10).unwrap());
        assert_ne!(whole, other);
    }

    proptest! {
        /// Pushing elements one by one keeps exactly those elements, and
        /// no two neighbouring runs could have been one.
        #[test]
        fn pushed_elements_are_kept_in_order(
            elements in prop::collection::vec((0u32..8, 0u64..3), 0..40)
        ) {
            let elements: Vec<_> = elements.into_iter().map(|(r, i)| e(r, i)).collect();
            let runs: ElementRuns = elements.iter().copied().collect();
            prop_assert_eq!(runs.to_vec(), elements.clone());
            prop_assert_eq!(runs.len(), elements.len());
            prop_assert_eq!(runs.iter().len(), elements.len());
            for pair in runs.runs().windows(2) {
                let [a, b] = pair else { unreachable!() };
                let joins = b.index() == a.index()
                    && u64::from(b.first().0) == u64::from(a.first().0) + u64::from(a.regions());
                prop_assert!(!joins, "{a:?} and {b:?} could be one run");
            }
        }
    }
}
