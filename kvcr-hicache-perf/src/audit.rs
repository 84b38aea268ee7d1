//! The placement audit: where a pool's pages really are (`get_mempolicy`,
//! `move_pages` in query mode) and whether huge pages took (`AnonHugePages`
//! of the pool's mappings in `/proc/self/smaps`).
//!
//! Unsafe, named: two raw syscalls, read-only (no page is moved, no policy
//! changed). Parsing is pure and tested on fixed text.

use std::collections::BTreeMap;

use kvcr_foundation::runner::{PlacementOutcome, PoolMemoryInfo};

use crate::error::{PerfError, Result};

/// `get_mempolicy` flag: `addr` names a mapping whose policy is wanted.
const MPOL_F_ADDR: libc::c_ulong = 2;
/// Nodemask words read back (1024 nodes).
const MASK_WORDS: usize = 16;
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

fn os(call: &'static str) -> PerfError {
    PerfError::Os {
        call,
        errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
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

/// The kernel's policy for the mapping at `addr`.
pub fn policy_at(addr: u64) -> Result<MemPolicy> {
    let mut mode: libc::c_int = 0;
    let mut mask = [0u64; MASK_WORDS];
    // SAFETY: `mode` and `mask` are valid out-pointers for one int and
    // `MASK_WORDS` words (maxnode = their bit count); `addr` is only looked
    // up (MPOL_F_ADDR), never dereferenced by the kernel on our behalf.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            (MASK_WORDS * 64) as libc::c_ulong,
            addr as usize as *mut libc::c_void,
            MPOL_F_ADDR,
        )
    };
    if rc != 0 {
        return Err(os("get_mempolicy"));
    }
    let nodes = (0..MASK_WORDS * 64)
        .filter(|&bit| {
            mask.get(bit / 64)
                .is_some_and(|w| w & (1 << (bit % 64)) != 0)
        })
        .filter_map(|bit| u16::try_from(bit).ok())
        .collect();
    Ok(MemPolicy {
        mode: mode_name(mode),
        nodes,
    })
}

/// Which node each of `pages` is on (`Err(errno)`: not present, etc.).
pub fn nodes_of(pages: &[u64]) -> Result<Vec<std::result::Result<u16, i32>>> {
    let ptrs: Vec<*mut libc::c_void> = pages
        .iter()
        .map(|&p| p as usize as *mut libc::c_void)
        .collect();
    let mut status = vec![0 as libc::c_int; ptrs.len()];
    // SAFETY: query mode (`nodes` is null): the kernel only reads `ptrs`
    // (`count` entries) and writes `status` (`count` ints); no page moves.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_int,
            ptrs.len() as libc::c_ulong,
            ptrs.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if rc < 0 {
        return Err(os("move_pages"));
    }
    Ok(status
        .into_iter()
        .map(|s| u16::try_from(s).map_err(|_| -s))
        .collect())
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
