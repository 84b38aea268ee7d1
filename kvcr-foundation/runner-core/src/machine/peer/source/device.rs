//! The one-hop route, source side: a `start_write` granting elements of a
//! target's device regions, checked before anything is put.
//!
//! A key's elements must all lie in device regions the target advertised
//! on this route (and that the driver opened); their sizes must add up to
//! exactly the page's bytes, which fill them in order (a page's slots and
//! the engine's elements need not be cut alike); and no element may be
//! named twice in one write (two keys' bytes racing into one place). A key
//! that breaks any rule is not written and counted as refused, as today's
//! bounds checks do; fences, the high-water mark, duplicates and stalls
//! were applied before.

use std::collections::HashSet;

use super::*;

/// The destination regions of one route, as a write is checked against.
pub(super) struct Grants<'a> {
    /// The target's advertised pool regions.
    pub(super) regions: &'a HashMap<RegionId, RegionAdvert>,
    /// Its device regions, when the driver opened them all.
    pub(super) device: Option<&'a DeviceGrants>,
}

impl<'a> Grants<'a> {
    /// The device regions a write naming `destinations` lands in, if it is
    /// a device write: its first element is in a device region (then every
    /// key's must be).
    pub(super) fn device_write(&self, destinations: &[ElementRuns]) -> Option<&'a DeviceGrants> {
        let first = destinations.first().and_then(ElementRuns::first)?;
        self.device
            .filter(|device| device.get(first.region).is_some())
    }
}

/// Whether any element appears twice among a write's `destinations`.
///
/// A layer-first engine grants each page one slot index across its
/// regions, named in region order, and each page its own slot: then no
/// element can repeat, which one pass over the keys' runs shows
/// ([`distinct_slots_in_region_order`]). Otherwise a sorted copy, each
/// element one 128-bit word, is searched for a neighbour equal to it (no
/// per-element hashing). On an H100 host's source the sort was a third of
/// a `start_write`'s check, and the checks of a restore's 453 writes set
/// when its first layer could land.
pub(super) fn names_an_element_twice(destinations: &[ElementRuns]) -> bool {
    if distinct_slots_in_region_order(destinations) {
        return false;
    }
    let mut all: Vec<u128> = destinations
        .iter()
        .flat_map(ElementRuns::iter)
        .map(|e| (u128::from(e.region.0) << 64) | u128::from(e.index))
        .collect();
    all.sort_unstable();
    all.windows(2).any(|w| w.first() == w.last())
}

/// Whether each key's elements share one index and name strictly
/// increasing regions, and no two keys share an index: then every element
/// is distinct (two of one key differ in region, two of different keys in
/// index). A run is such elements already, so this looks at each run, not
/// each element, and sorts only the keys' indices.
fn distinct_slots_in_region_order(destinations: &[ElementRuns]) -> bool {
    let mut slots = Vec::with_capacity(destinations.len());
    for elements in destinations {
        let runs = elements.runs();
        let Some(first) = runs.first() else {
            continue;
        };
        // Runs join in order when each starts past the last one's end.
        let one_slot_in_order = runs.windows(2).all(|w| {
            matches!(w, [a, b] if a.index() == b.index()
                && u64::from(a.first().0) + u64::from(a.regions()) <= u64::from(b.first().0))
        });
        if !one_slot_in_order {
            return false;
        }
        slots.push(first.index());
    }
    slots.sort_unstable();
    slots.windows(2).all(|w| matches!(w, [a, b] if a != b))
}

/// Appends to `puts` the puts that write a page held in `sources` (its
/// slots, in layout order) into the device elements `dests`, in order: the
/// page's bytes fill the elements one after the other; `Some(the page's
/// bytes)`. `None`, with nothing appended, when an element is outside the
/// advertised device regions, named twice in the write (`seen` holds the
/// write's elements so far; `None` when the write names none twice, see
/// [`names_an_element_twice`]), or the sizes do not add up to the page's.
pub(super) fn device_puts(
    sources: &[CopySpan],
    dests: &ElementRuns,
    device: &DeviceGrants,
    seen: Option<&mut HashSet<ElementRef>>,
    puts: &mut Vec<PutSpan>,
) -> Option<u64> {
    let start = puts.len();
    if seen.is_none() {
        if let Some(page) = alike_puts(sources, dests, device, puts) {
            return Some(page);
        }
        puts.truncate(start);
    }
    let page = page_puts(sources, dests, device, seen, puts);
    if page.is_none() {
        puts.truncate(start);
    }
    page
}

/// [`page_puts`] for the common page, as the direct linker's layer-first
/// pages are: one slot per element, each exactly its element's size, in a
/// write that names no element twice. One put per element, no slot cut
/// across elements. `None` when the page
/// is not of that shape or breaks a rule; the caller then drops what this
/// appended and takes the general walk, which refuses what breaks a rule.
fn alike_puts(
    sources: &[CopySpan],
    dests: &ElementRuns,
    device: &DeviceGrants,
    puts: &mut Vec<PutSpan>,
) -> Option<u64> {
    if sources.len() != dests.len() {
        return None;
    }
    let mut page = 0u64;
    let mut last = None;
    for (element, src) in dests.iter().zip(sources) {
        let at = device.position_after(element.region, last)?;
        last = Some(at);
        let region = device.at(at)?;
        if src.len == 0 || src.len != region.element_size || element.index >= region.count {
            return None;
        }
        page = page.checked_add(src.len)?;
        puts.push(PutSpan {
            local: src.src,
            remote: region
                .base
                .checked_add(element.index.checked_mul(region.stride)?)?,
            len: src.len,
            region: element.region,
        });
    }
    (page > 0).then_some(page)
}

/// [`device_puts`] in one walk over both lists: each element is checked
/// and then cut from the slots at once, each put the overlap of the
/// current slot span and the element (one per element where both are cut
/// alike); the caller drops what this appended when it returns `None`.
fn page_puts(
    sources: &[CopySpan],
    dests: &ElementRuns,
    device: &DeviceGrants,
    mut seen: Option<&mut HashSet<ElementRef>>,
    puts: &mut Vec<PutSpan>,
) -> Option<u64> {
    let page: u64 = sources.iter().map(|s| s.len).sum();
    let (mut s, mut s_off) = (0usize, 0u64);
    let mut granted = 0u64;
    let mut last = None;
    for element in dests.iter() {
        let at = device.position_after(element.region, last)?;
        last = Some(at);
        let region = device.at(at)?;
        if element.index >= region.count || seen.as_mut().is_some_and(|seen| !seen.insert(element))
        {
            return None;
        }
        let address = region
            .base
            .checked_add(element.index.checked_mul(region.stride)?)?;
        granted = granted.checked_add(region.element_size)?;
        if granted > page {
            return None;
        }
        let mut t_off = 0;
        while t_off < region.element_size {
            // `granted <= page`: the slots hold this element's bytes.
            let src = sources.get(s)?;
            let len = (src.len - s_off).min(region.element_size - t_off);
            if len > 0 {
                puts.push(PutSpan {
                    local: src.src + s_off,
                    remote: address + t_off,
                    len,
                    region: element.region,
                });
            }
            s_off += len;
            t_off += len;
            if s_off == src.len {
                (s, s_off) = (s + 1, 0);
            }
        }
    }
    (granted == page && page > 0).then_some(page)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::tests::element;
    use kvcr_contracts::protocol::ElementRun;

    /// Each key's elements, as a layer-first engine grants them: `regions`
    /// regions in order, at the key's slot.
    fn layer_first(slots: &[u64], regions: u32) -> Vec<Vec<ElementRef>> {
        slots
            .iter()
            .map(|&slot| (0..regions).map(|r| element(r, slot)).collect())
            .collect()
    }

    /// Each key's elements as runs, cut into the longest.
    fn runs(keys: &[Vec<ElementRef>]) -> Vec<ElementRuns> {
        keys.iter().map(|k| ElementRuns::from_elements(k)).collect()
    }

    /// Each key's elements as runs of one element each, as a target may
    /// send them.
    fn one_element_runs(keys: &[Vec<ElementRef>]) -> Vec<ElementRuns> {
        keys.iter()
            .map(|k| {
                let mut runs = ElementRuns::new();
                for e in k {
                    runs.push_run(ElementRun::new(e.region, 1, e.index).unwrap());
                }
                runs
            })
            .collect()
    }

    #[test]
    fn a_layer_first_grant_takes_the_one_pass() {
        let granted = layer_first(&[3, 9, 4, 0], 128);
        assert!(distinct_slots_in_region_order(&runs(&granted)));
        assert!(!names_an_element_twice(&runs(&granted)));
    }

    #[test]
    fn a_repeat_the_one_pass_cannot_rule_out_is_found() {
        // Two keys granted one slot.
        let shared_slot = layer_first(&[3, 9, 3], 4);
        assert!(!distinct_slots_in_region_order(&runs(&shared_slot)));
        assert!(names_an_element_twice(&runs(&shared_slot)));
        // One key naming a region twice.
        let mut twice = layer_first(&[1, 2], 4);
        twice[1][3] = element(2, 2);
        assert!(names_an_element_twice(&runs(&twice)));
        // Out of region order but distinct: the sort clears it.
        let mut swapped = layer_first(&[1, 2], 4);
        swapped[0].swap(0, 1);
        assert!(!distinct_slots_in_region_order(&runs(&swapped)));
        assert!(!names_an_element_twice(&runs(&swapped)));
        // Two keys' elements at different slots of one region each, the
        // same element in the end: one key's slot is another's.
        let crossed = vec![
            vec![element(0, 5), element(1, 6)],
            vec![element(0, 6), element(1, 6)],
        ];
        assert!(names_an_element_twice(&runs(&crossed)));
    }

    proptest! {
        /// Whatever the grant, the answer is a set's: the one pass never
        /// clears a write that names an element twice.
        #[test]
        fn the_answer_is_a_sets(
            keys in prop::collection::vec(
                prop::collection::vec((0u32..4, 0u64..4), 0..6),
                0..6,
            ),
            layered in any::<bool>(),
        ) {
            let granted: Vec<Vec<ElementRef>> = if layered {
                // Mostly well formed: one slot per key, regions in order.
                keys.iter()
                    .map(|k| {
                        let slot = k.first().map_or(0, |e| e.1);
                        (0..k.len() as u32).map(|r| element(r, slot)).collect()
                    })
                    .collect()
            } else {
                keys.iter()
                    .map(|k| k.iter().map(|&(r, i)| element(r, i)).collect())
                    .collect()
            };
            let mut seen = HashSet::new();
            let repeats = !granted.iter().flatten().all(|e| seen.insert(*e));
            prop_assert_eq!(names_an_element_twice(&runs(&granted)), repeats);
            // However the target cut them into runs.
            prop_assert_eq!(names_an_element_twice(&one_element_runs(&granted)), repeats);
        }
    }

    /// Two device regions (ids 4 and 7) of 4-byte elements, 16 apart, 8 each.
    fn grants() -> DeviceGrants {
        let region = |id: u32, base: u64| DeviceRegionAdvert {
            id: RegionId(id),
            base,
            element_size: 4,
            stride: 16,
            count: 8,
            export: vec![1],
        };
        DeviceGrants::new(&[region(7, 0x9000), region(4, 0x1000)])
    }

    fn span(src: u64, len: u64) -> CopySpan {
        CopySpan { src, dst: 0, len }
    }

    fn put(local: u64, remote: u64, len: u64, region: u32) -> PutSpan {
        PutSpan {
            local,
            remote,
            len,
            region: RegionId(region),
        }
    }

    #[test]
    fn a_page_cut_unlike_its_elements_fills_them_in_order() {
        // Slots of 6 and 2 bytes into two 4-byte elements: three puts.
        let mut puts = vec![put(1, 1, 1, 0)];
        let page = device_puts(
            &[span(0x100, 6), span(0x200, 2)],
            &ElementRuns::from_elements(&[element(4, 2), element(7, 5)]),
            &grants(),
            None,
            &mut puts,
        );
        assert_eq!(page, Some(8));
        assert_eq!(
            puts[1..],
            [
                put(0x100, 0x1000 + 2 * 16, 4, 4),
                put(0x104, 0x9000 + 5 * 16, 2, 7),
                put(0x200, 0x9000 + 5 * 16 + 2, 2, 7),
            ]
        );
    }

    #[rstest::rstest]
    #[case::index_past_the_region(vec![element(4, 8), element(7, 0)], vec![span(0, 8)])]
    #[case::region_not_advertised(vec![element(4, 0), element(5, 0)], vec![span(0, 8)])]
    #[case::page_larger_than_granted(vec![element(4, 0)], vec![span(0, 8)])]
    #[case::page_smaller_than_granted(vec![element(4, 0), element(7, 0)], vec![span(0, 6)])]
    #[case::an_empty_page(vec![element(4, 0)], vec![span(0, 0)])]
    fn a_bad_grant_appends_nothing(#[case] dests: Vec<ElementRef>, #[case] slots: Vec<CopySpan>) {
        let mut puts = vec![put(1, 1, 1, 0)];
        assert_eq!(
            device_puts(&slots, &dests.into(), &grants(), None, &mut puts),
            None
        );
        assert_eq!(puts, [put(1, 1, 1, 0)]);
    }

    #[test]
    fn an_element_named_twice_is_refused_when_looked_for() {
        let dests = ElementRuns::from_elements(&[element(4, 1), element(4, 1)]);
        let slots = [span(0, 8)];
        let mut puts = Vec::new();
        let mut seen = HashSet::new();
        assert_eq!(
            device_puts(&slots, &dests, &grants(), Some(&mut seen), &mut puts),
            None
        );
        assert!(puts.is_empty());
    }

    /// A layer-first page (one slot per element, each an element's size)
    /// takes the one-put-per-element path, and it puts what the general
    /// walk puts.
    #[test]
    fn a_layer_first_page_takes_the_alike_path() {
        let mut puts = Vec::new();
        let dests = ElementRuns::from_elements(&[element(4, 3), element(7, 3)]);
        let slots = [span(0x100, 4), span(0x200, 4)];
        assert_eq!(alike_puts(&slots, &dests, &grants(), &mut puts), Some(8));
        let mut general = Vec::new();
        assert_eq!(
            page_puts(&slots, &dests, &grants(), None, &mut general),
            Some(8)
        );
        assert_eq!(puts, general);
        assert_eq!(
            puts,
            [
                put(0x100, 0x1000 + 3 * 16, 4, 4),
                put(0x200, 0x9000 + 3 * 16, 4, 7)
            ]
        );
    }

    proptest! {
        /// Whatever the page and its grant, the alike path either declines
        /// or puts exactly what the general walk puts. Pages are drawn
        /// mostly of its shape (a slot per element, mostly an element's
        /// size), over [`grants`] and a region 9 of empty elements.
        #[test]
        fn the_alike_path_agrees_with_the_general_walk(
            page in prop::collection::vec(
                (
                    prop::sample::select(vec![3u32, 4, 7, 9]),
                    0u64..10,
                    prop::sample::select(vec![4u64, 4, 4, 0, 2]),
                ),
                1..5,
            ),
        ) {
            let mut regions = grants().sorted;
            regions.push(DeviceRegionAdvert {
                id: RegionId(9),
                base: 0x20000,
                element_size: 0,
                stride: 16,
                count: 8,
                export: vec![1],
            });
            let device = DeviceGrants::new(&regions);
            let dests: ElementRuns = page.iter().map(|&(r, i, _)| element(r, i)).collect();
            let slots: Vec<CopySpan> = page
                .iter()
                .zip(1u64..)
                .map(|(&(_, _, len), i)| span(0x100 * i, len))
                .collect();
            let mut alike = Vec::new();
            let mut general = Vec::new();
            let general_page = page_puts(&slots, &dests, &device, None, &mut general);
            if let Some(page) = alike_puts(&slots, &dests, &device, &mut alike) {
                prop_assert_eq!(Some(page), general_page);
                prop_assert_eq!(alike, general);
            }
        }
    }
}
