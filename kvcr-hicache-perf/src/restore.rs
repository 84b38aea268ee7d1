//! The coalesced restore fast path: claim resident pages (`fetch`), plan
//! their spans (coalesced or not), copy them into engine memory while the
//! claims are held, then release. Pages that are not resident take the
//! normal path (`deliver`, hinted when a request is given): the sparse
//! fallback.
//!
//! Guarantees kept from the base path: source claims are held until every
//! copy from them is done; destinations are only elements of regions the
//! caller registered, bounds-checked here against their descriptors; a source
//! is only a slot the runner returned for a live claim, bounds-checked
//! against the runner's pool memory; nothing is released before it is
//! terminal (a fetch or deliver is waited for until the runner completes it,
//! which its operation deadline guarantees).

use std::collections::HashMap;
use std::time::Duration;

use kvcr_foundation::hint::RequestId;
use kvcr_foundation::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_foundation::runner::{DeliverEntry, OpResult, PoolId, RegionDesc, Runner};
use kvcr_foundation::tier::Owner;

use crate::coalesce::{CoalesceOptions, Descriptor, Direction, Location, plan};
use crate::copy::{RawCopy, copy_all};
use crate::error::{PerfError, Result};

/// A framework region as the caller registered it with the runner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRegion {
    /// The id `register_region` returned.
    pub id: RegionId,
    /// The descriptor it was registered with.
    pub desc: RegionDesc,
}

/// What a restore did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RestoreReport {
    /// Per entry, in order: every span restored.
    pub restored: Vec<bool>,
    /// Transfer operations the fast path would issue without coalescing.
    pub ops_uncoalesced: usize,
    /// Transfer operations it issued.
    pub ops: usize,
    /// Entries that took the normal path (not resident here).
    pub fallback: usize,
}

/// Waits for `op` alone: other callers' results stay with the runner for
/// them. The runner's operation deadline bounds the wait.
fn wait_for(runner: &Runner, op: OpHandle) -> Result<OpResult> {
    loop {
        if let Some(result) = runner.wait(op, Duration::from_millis(100))? {
            return Ok(result);
        }
    }
}

fn bad(why: &'static str) -> PerfError {
    PerfError::Config {
        field: "restore",
        why,
    }
}

/// Restores `entries` (key → destination elements, one per span, in the
/// layout `layout`) from KVCR DRAM through the fast path, coalescing as
/// `options` says; keys not resident take the normal path.
///
/// # Safety
/// Every region in `hosts` must be registered with `runner` under exactly
/// that id and descriptor (so its memory is valid for the runner's life), and
/// the caller must not access a destination element until this returns.
pub unsafe fn restore(
    runner: &Runner,
    hosts: &[HostRegion],
    layout: &[PoolId],
    entries: Vec<DeliverEntry>,
    request: Option<&RequestId>,
    options: CoalesceOptions,
) -> Result<RestoreReport> {
    let mut report = RestoreReport {
        restored: vec![false; entries.len()],
        ..RestoreReport::default()
    };
    if entries.is_empty() {
        return Ok(report);
    }
    let host_of: HashMap<RegionId, &RegionDesc> = hosts.iter().map(|h| (h.id, &h.desc)).collect();
    for entry in &entries {
        if entry.destinations.len() != layout.len() {
            return Err(bad("an entry's destinations differ from the layout"));
        }
        for d in &entry.destinations {
            let desc = host_of
                .get(&d.region)
                .ok_or(bad("a destination region is not a given host region"))?;
            if d.index >= desc.count {
                return Err(bad("a destination element is outside its region"));
            }
        }
    }
    let keys: Vec<_> = entries.iter().map(|e| e.key).collect();
    let op = runner.fetch(&keys, layout)?;
    let fetched = wait_for(runner, op)?;
    // Fetch deduplicates keys; map each key to its claim and slots.
    let mut claims: HashMap<
        _,
        (
            Option<kvcr_foundation::runner::ReleaseHandle>,
            Vec<ElementRef>,
        ),
    > = HashMap::new();
    for (key, result) in &fetched.entries {
        if result.is_success() {
            claims.insert(*key, (result.release, result.slots.clone()));
        }
    }
    let pools = runner.pool_memory().to_vec();
    let mut descriptors = Vec::new();
    let mut owners = Vec::new(); // descriptor -> entry
    let mut fallback = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let Some((_, slots)) = claims.get(&entry.key) else {
            fallback.push(i);
            continue;
        };
        if slots.len() != entry.destinations.len() {
            fallback.push(i);
            continue;
        }
        for (slot, dst) in slots.iter().zip(&entry.destinations) {
            let Some(desc) = host_of.get(&dst.region) else {
                continue;
            };
            descriptors.push(Descriptor {
                owner: Owner::Kvcr,
                direction: Direction::Restore,
                src: Location {
                    region: slot.region.0,
                    offset: slot.index * desc.size,
                },
                dst: Location {
                    region: dst.region.0,
                    offset: dst.index * desc.effective_stride(),
                },
                len: desc.size,
            });
            owners.push(i);
        }
    }
    let base = plan(&descriptors, CoalesceOptions::default());
    let planned = plan(&descriptors, options);
    report.ops_uncoalesced = base.ops();
    report.ops = planned.ops();
    // Resolve and bounds-check every transfer before copying anything.
    let mut copies = Vec::with_capacity(planned.ops());
    let mut copy_ok = true;
    for t in &planned.transfers {
        let pool = usize::try_from(t.src.region)
            .ok()
            .and_then(|r| pools.get(r));
        let host = host_of.get(&RegionId(t.dst.region));
        let (Some(pool), Some(host)) = (pool, host) else {
            copy_ok = false;
            break;
        };
        let src_end = t.src.offset.checked_add(t.len);
        let host_extent = host
            .effective_stride()
            .checked_mul(host.count.saturating_sub(1))
            .and_then(|x| x.checked_add(host.size));
        let dst_end = t.dst.offset.checked_add(t.len);
        // A merged transfer spans several elements: only dense regions
        // (stride == size) are contiguous between elements.
        let dense = host.effective_stride() == host.size || t.parts.len() == 1;
        if !(dense
            && src_end.is_some_and(|e| e <= pool.len)
            && dst_end.zip(host_extent).is_some_and(|(e, x)| e <= x))
        {
            copy_ok = false;
            break;
        }
        copies.push(RawCopy {
            src: pool.base + t.src.offset,
            dst: host.base + t.dst.offset,
            len: t.len,
        });
    }
    if copy_ok {
        // SAFETY: sources are slots of the runner's own pools (bounds-checked
        // above against `pool_memory`) held READY by claims taken above and
        // released only below, so nothing writes them; destinations are
        // elements of regions the caller registered (this function's
        // contract; bounds-checked above) and does not touch until we return;
        // the runner refuses regions that overlap its pools.
        unsafe { copy_all(&copies) };
        for &i in &owners {
            if let Some(r) = report.restored.get_mut(i) {
                *r = true;
            }
        }
    }
    let handles: Vec<_> = claims.values().filter_map(|(h, _)| *h).collect();
    runner.release(&handles);
    // The sparse fallback: the normal path for pages not resident here.
    if !fallback.is_empty() {
        report.fallback = fallback.len();
        let normal: Vec<DeliverEntry> = fallback
            .iter()
            .filter_map(|&i| entries.get(i).cloned())
            .collect();
        let op = match request {
            Some(r) => runner.deliver_hinted(r, normal)?,
            None => runner.deliver(normal)?,
        };
        let result = wait_for(runner, op)?;
        for (&i, (_, r)) in fallback.iter().zip(&result.entries) {
            if let Some(slot) = report.restored.get_mut(i) {
                *slot = r.is_success();
            }
        }
    }
    Ok(report)
}
