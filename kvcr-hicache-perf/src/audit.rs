//! The placement audit: where a pool's pages really are (`get_mempolicy`,
//! `move_pages` in query mode) and whether huge pages took (`AnonHugePages`
//! of the pool's mappings in `/proc/self/smaps`).
//!
//! The two raw syscalls (read-only: no page is moved, no policy changed)
//! are `kvcr_sys::mapping`'s; parsing is pure and tested on fixed text.

use std::collections::BTreeMap;

use kvcr_foundation::runner::{PlacementOutcome, PoolMemoryInfo};
use kvcr_foundation::sys::SysError;
use kvcr_foundation::sys::error::PoolMemoryReason;
use kvcr_foundation::sys::mapping::{mempolicy_at, page_nodes};

use crate::error::{PerfError, Result};

const PAGE: u64 = 4096;

/// A mapping's NUMA policy as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemPolicy {
    /// `default`, `preferred`, `bind`, `interleave`, `local`, or the number.
    pub mode: String,
    /// The policy's nodes (empty for `default`).
    pub nodes: Vec<u16>,
}

/// One pool's audit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolAudit {
    /// Pool name.
    pub name: String,
    /// Bytes.
    pub len: u64,
    /// The placement the runner reports having applied.
    pub placement: Option<PlacementOutcome>,
    /// The policy the kernel holds for the pool's first page.
    pub policy: MemPolicy,
    /// Pages asked about (evenly spaced over the pool).
    pub pages_sampled: u64,
    /// Sampled pages per node they are on.
    pub pages_per_node: BTreeMap<u16, u64>,
    /// Sampled pages not present (never touched, or swapped out).
    pub pages_absent: u64,
    /// `AnonHugePages` of the mappings that overlap the pool.
    pub anon_huge_bytes: u64,
    /// Bytes of those mappings (may exceed the pool when the kernel merged it
    /// with a neighbour of the same flags).
    pub mapping_bytes: u64,
}

impl PoolAudit {
    /// Whether any of the pool is backed by huge pages.
    pub fn huge_pages_took(&self) -> bool {
        self.anon_huge_bytes > 0
    }

    /// Whether every sampled page is present and on one of `nodes`.
    pub fn all_on(&self, nodes: &[u16]) -> bool {
        self.pages_absent == 0 && self.pages_per_node.keys().all(|node| nodes.contains(node))
    }
}

fn mode_name(mode: i32) -> String {
    match mode {
        libc::MPOL_DEFAULT => "default".into(),
        libc::MPOL_PREFERRED => "preferred".into(),
        libc::MPOL_BIND => "bind".into(),
        libc::MPOL_INTERLEAVE => "interleave".into(),
        libc::MPOL_LOCAL => "local".into(),
        other => other.to_string(),
    }
}

/// A kernel refusal (`PoolMemoryReason::Os`) as this crate's `Os`; anything
/// else as an `Os` of `call` (the queries refuse nothing else).
fn os(call: &'static str, error: SysError) -> PerfError {
    match error {
        SysError::PoolMemory(PoolMemoryReason::Os { call, errno }) => PerfError::Os { call, errno },
        _ => PerfError::Os { call, errno: 0 },
    }
}

/// The kernel's policy for the mapping at `addr`.
pub fn policy_at(addr: u64) -> Result<MemPolicy> {
    let (mode, nodes) = mempolicy_at(addr).map_err(|e| os("get_mempolicy", e))?;
    Ok(MemPolicy {
        mode: mode_name(mode),
        nodes,
    })
}

/// Which node each of `pages` is on (`Err(errno)`: not present, etc.).
pub fn nodes_of(pages: &[u64]) -> Result<Vec<std::result::Result<u16, i32>>> {
    page_nodes(pages).map_err(|e| os("move_pages", e))
}

/// Sums `AnonHugePages` (bytes) and the sizes of the mappings in `smaps`
/// text that overlap `base..base+len`.
pub fn anon_huge_bytes(smaps: &str, base: u64, len: u64) -> (u64, u64) {
    let end = base.saturating_add(len);
    let (mut huge, mut mapped) = (0, 0);
    let mut overlapping = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-')
            && let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16))
        {
            overlapping = lo < end && base < hi;
            if overlapping {
                mapped += hi - lo;
            }
            continue;
        }
        if overlapping && let Some(rest) = line.strip_prefix("AnonHugePages:") {
            let kib: u64 = rest
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            huge += kib * 1024;
        }
    }
    (huge, mapped)
}

/// Audits one pool, asking about at most `max_samples` evenly spaced pages.
pub fn audit(info: &PoolMemoryInfo, max_samples: u64) -> Result<PoolAudit> {
    let pages = info.len.div_ceil(PAGE).max(1);
    let samples = pages.min(max_samples.max(1));
    let step = pages / samples;
    let addrs: Vec<u64> = (0..samples).map(|i| info.base + i * step * PAGE).collect();
    let mut pages_per_node = BTreeMap::new();
    let mut pages_absent = 0;
    for status in nodes_of(&addrs)? {
        match status {
            Ok(node) => *pages_per_node.entry(node).or_insert(0) += 1,
            Err(_) => pages_absent += 1,
        }
    }
    let smaps = std::fs::read_to_string("/proc/self/smaps").map_err(|e| PerfError::Os {
        call: "read /proc/self/smaps",
        errno: e.raw_os_error().unwrap_or(0),
    })?;
    let (anon_huge_bytes, mapping_bytes) = anon_huge_bytes(&smaps, info.base, info.len);
    Ok(PoolAudit {
        name: info.name.clone(),
        len: info.len,
        placement: info.placement.clone(),
        policy: policy_at(info.base)?,
        pages_sampled: samples,
        pages_per_node,
        pages_absent,
        anon_huge_bytes,
        mapping_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      2048 kB
THPeligible:    1
7f0000400000-7f0000401000 r--p 00000000 08:01 42   /usr/lib/libc.so
AnonHugePages:         0 kB
7f0000600000-7f0000800000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
";

    #[test]
    fn smaps_huge_pages_are_summed_over_overlapping_mappings_only() {
        assert_eq!(
            anon_huge_bytes(SMAPS, 0x7f00_0000_0000, 0x40_0000),
            (2 << 20, 4 << 20)
        );
        assert_eq!(
            anon_huge_bytes(SMAPS, 0x7f00_0000_0000, 0x80_0000),
            (4 << 20, (4 << 20) + 4096 + (2 << 20))
        );
        assert_eq!(anon_huge_bytes(SMAPS, 0x10, 0x10), (0, 0));
    }

    #[test]
    fn mode_names() {
        assert_eq!(mode_name(libc::MPOL_BIND), "bind");
        assert_eq!(mode_name(99), "99");
    }
}
