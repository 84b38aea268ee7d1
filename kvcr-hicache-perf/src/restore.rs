//! The coalesced restore fast path: claim resident pages (`fetch`), plan
//! their spans (coalesced or not), copy them into engine memory while the
//! claims are held, then release. Pages that are not resident take the
//! normal path (`deliver`, hinted when a request is given): the sparse
//! fallback.
//!
//! Guarantees kept from the base path: source claims are held until every
//! copy from them is done; the copies are the runner's
//! (`Runner::copy_claimed`), which refuses a run that leaves the slots the
//! claims hold or a destination that leaves a registered framework host
//! element (a run spans several elements only in a dense region), so this
//! module has no unsafe code; nothing is released before it is terminal (a
//! fetch or deliver is waited for until the runner completes it, which its
//! operation deadline guarantees).

use std::collections::HashMap;
use std::time::Duration;

use kvcr_foundation::hint::RequestId;
use kvcr_foundation::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_foundation::runner::{ClaimedCopy, DeliverEntry, OpResult, PoolId, RegionDesc, Runner};
use kvcr_foundation::tier::Owner;

use crate::coalesce::{CoalesceOptions, Descriptor, Direction, Location, plan};
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
/// `hosts` are the caller's registered regions (id and descriptor as
/// `register_region` got them); they shape the plan, and the runner checks
/// every run against its own registrations before it copies
/// (`Runner::copy_claimed`), so a wrong descriptor is refused, never a write
/// outside a registered element. As with any runner operation, the caller
/// does not touch a destination element until this returns.
pub fn restore(
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
    // Each transfer becomes a run the runner bounds-checks against the claims
    // and the registrations, then copies (the offsets above are whole
    // elements, so dividing them back is exact).
    let runs: Option<Vec<ClaimedCopy>> = planned
        .transfers
        .iter()
        .map(|t| {
            let desc = host_of.get(&RegionId(t.dst.region))?;
            Some(ClaimedCopy {
                src: ElementRef {
                    region: RegionId(t.src.region),
                    index: t.src.offset / desc.size.max(1),
                },
                dst: ElementRef {
                    region: RegionId(t.dst.region),
                    index: t.dst.offset / desc.effective_stride().max(1),
                },
                len: t.len,
            })
        })
        .collect();
    let handles: Vec<_> = claims.values().filter_map(|(h, _)| *h).collect();
    // A plan the runner refuses (a run it cannot prove is inside the claims
    // or the caller's regions) copies nothing; those entries stay unrestored.
    if runs.is_some_and(|runs| runner.copy_claimed(&handles, &runs).is_ok()) {
        for &i in &owners {
            if let Some(r) = report.restored.get_mut(i) {
                *r = true;
            }
        }
    }
    runner.release(&handles);
    // The sparse fallback: the normal path for pages not resident here.
    if !fallback.is_empty() {
        report.fallback = fallback.len();
        let normal: Vec<DeliverEntry> = fallback
            .iter()
            .filter_map(|&i| entries.get(i).cloned())
            .collect();
        let op = match request {
            Some(r) => runner.hints().deliver(r, normal)?,
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
