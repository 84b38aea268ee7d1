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
    pub(super) fn device_write(
        &self,
        destinations: &[Vec<ElementRef>],
    ) -> Option<&'a DeviceGrants> {
        let first = destinations.first().and_then(|d| d.first())?;
        self.device
            .filter(|device| device.contains_key(&first.region))
    }
}

/// Whether any element appears twice among a write's `destinations`.
///
/// A layer-first engine grants each page one slot index across its
/// regions, named in region order, and each page its own slot: then no
/// element can repeat, which one pass over the elements shows
/// ([`distinct_slots_in_region_order`]). Otherwise a sorted copy, each
/// element one 128-bit word, is searched for a neighbour equal to it (no
/// per-element hashing). On an H100 host's source the sort was a third of
/// a `start_write`'s check, and the checks of a restore's 453 writes set
/// when its first layer could land.
pub(super) fn names_an_element_twice(destinations: &[Vec<ElementRef>]) -> bool {
    if distinct_slots_in_region_order(destinations) {
        return false;
    }
    let mut all: Vec<u128> = destinations
        .iter()
        .flatten()
        .map(|e| (u128::from(e.region.0) << 64) | u128::from(e.index))
        .collect();
    all.sort_unstable();
    all.windows(2).any(|w| w.first() == w.last())
}

/// Whether each key's elements share one index and name strictly
/// increasing regions, and no two keys share an index: then every element
/// is distinct (two of one key differ in region, two of different keys in
/// index). Sorts only the keys' indices.
fn distinct_slots_in_region_order(destinations: &[Vec<ElementRef>]) -> bool {
    let mut slots = Vec::with_capacity(destinations.len());
    for elements in destinations {
        let Some(first) = elements.first() else {
            continue;
        };
        let one_slot_in_order = elements
            .windows(2)
            .all(|w| matches!(w, [a, b] if a.region < b.region && a.index == b.index));
        if !one_slot_in_order {
            return false;
        }
        slots.push(first.index);
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
    dests: &[ElementRef],
    device: &DeviceGrants,
    mut seen: Option<&mut HashSet<ElementRef>>,
    puts: &mut Vec<PutSpan>,
) -> Option<u64> {
    let mut targets = Vec::with_capacity(dests.len());
    for element in dests {
        let region = device.get(&element.region)?;
        if element.index >= region.count || seen.as_mut().is_some_and(|seen| !seen.insert(*element))
        {
            return None;
        }
        let address = region
            .base
            .checked_add(element.index.checked_mul(region.stride)?)?;
        targets.push((address, region.element_size, element.region));
    }
    let page: u64 = sources.iter().map(|s| s.len).sum();
    let granted = targets
        .iter()
        .try_fold(0u64, |sum, (_, len, _)| sum.checked_add(*len))?;
    if page != granted || page == 0 {
        return None;
    }
    // Walk both lists at once: each put is the overlap of the current slot
    // span and the current element (one per element where both are cut
    // alike).
    puts.reserve(targets.len().max(sources.len()));
    let (mut s, mut s_off, mut t, mut t_off) = (0usize, 0u64, 0usize, 0u64);
    while let (Some(src), Some((dst, dst_len, region))) = (sources.get(s), targets.get(t)) {
        let len = (src.len - s_off).min(dst_len - t_off);
        if len > 0 {
            puts.push(PutSpan {
                local: src.src + s_off,
                remote: dst + t_off,
                len,
                region: *region,
            });
        }
        s_off += len;
        t_off += len;
        if s_off == src.len {
            (s, s_off) = (s + 1, 0);
        }
        if t_off == *dst_len {
            (t, t_off) = (t + 1, 0);
        }
    }
    Some(page)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn element(region: u32, index: u64) -> ElementRef {
        ElementRef {
            region: RegionId(region),
            index,
        }
    }

    /// Each key's elements, as a layer-first engine grants them: `regions`
    /// regions in order, at the key's slot.
    fn layer_first(slots: &[u64], regions: u32) -> Vec<Vec<ElementRef>> {
        slots
            .iter()
            .map(|&slot| (0..regions).map(|r| element(r, slot)).collect())
            .collect()
    }

    #[test]
    fn a_layer_first_grant_takes_the_one_pass() {
        let granted = layer_first(&[3, 9, 4, 0], 128);
        assert!(distinct_slots_in_region_order(&granted));
        assert!(!names_an_element_twice(&granted));
    }

    #[test]
    fn a_repeat_the_one_pass_cannot_rule_out_is_found() {
        // Two keys granted one slot.
        let shared_slot = layer_first(&[3, 9, 3], 4);
        assert!(!distinct_slots_in_region_order(&shared_slot));
        assert!(names_an_element_twice(&shared_slot));
        // One key naming a region twice.
        let mut twice = layer_first(&[1, 2], 4);
        twice[1][3] = element(2, 2);
        assert!(names_an_element_twice(&twice));
        // Out of region order but distinct: the sort clears it.
        let mut swapped = layer_first(&[1, 2], 4);
        swapped[0].swap(0, 1);
        assert!(!distinct_slots_in_region_order(&swapped));
        assert!(!names_an_element_twice(&swapped));
        // Two keys' elements at different slots of one region each, the
        // same element in the end: one key's slot is another's.
        let crossed = vec![
            vec![element(0, 5), element(1, 6)],
            vec![element(0, 6), element(1, 6)],
        ];
        assert!(names_an_element_twice(&crossed));
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
            prop_assert_eq!(names_an_element_twice(&granted), repeats);
        }
    }
}
