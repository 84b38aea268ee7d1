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

/// Whether any element appears twice among a write's `destinations`
/// (sorting a copy, each element one 128-bit word: no per-element hashing).
pub(super) fn names_an_element_twice(destinations: &[Vec<ElementRef>]) -> bool {
    let mut all: Vec<u128> = destinations
        .iter()
        .flatten()
        .map(|e| (u128::from(e.region.0) << 64) | u128::from(e.index))
        .collect();
    all.sort_unstable();
    all.windows(2).any(|w| w.first() == w.last())
}

/// The puts that write a page held in `sources` (its slots, in layout
/// order) into the device elements `dests`, in order: the page's bytes fill
/// the elements one after the other. `None` when an element is outside the
/// advertised device regions, named twice in the write (`seen` holds the
/// write's elements so far; `None` when the write names none twice, see
/// [`names_an_element_twice`]), or the sizes do not add up to the page's.
pub(super) fn device_puts(
    sources: &[CopySpan],
    dests: &[ElementRef],
    device: &DeviceGrants,
    mut seen: Option<&mut HashSet<ElementRef>>,
) -> Option<Vec<PutSpan>> {
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
    // span and the current element.
    let mut puts = Vec::new();
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
    Some(puts)
}
