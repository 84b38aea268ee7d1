//! Pool placement: the options (anonymous memory, transparent huge pages, a
//! NUMA policy) and the host's answers read from sysfs and procfs (online
//! nodes, THP modes, mapping counts, huge-page bytes per range). Pure data
//! and file reads, no unsafe: the mappings these options place are in
//! [`crate::mapping`].
//!
//! Off by default ([`PoolMemory::Default`] keeps the runner's original
//! allocation); `kvcr-hicache-perf` builds these options and audits where
//! the pages really went. Nothing here is silent: a node that does not
//! exist or a policy the kernel refuses is an error; huge pages that cannot
//! be had are an error ([`HugePages::Require`]) or a downgrade recorded in
//! the [`PlacementOutcome`] ([`HugePages::Prefer`]).

use crate::error::{PoolMemoryReason, Result};

/// How the runner backs its pools.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PoolMemory {
    /// The runner's original allocation: page-aligned heap memory in local
    /// mode; in peer mode a sealed memfd mapped shared (what a same-host
    /// source maps to write with one copy), with transparent huge pages
    /// where the host allows them for shared memory
    /// ([`shared_memory_huge_pages`]: the host's mode is the control), or a
    /// plain anonymous mapping registered with UCX when
    /// `PeerOptions::same_host_mapping` is off.
    #[default]
    Default,
    /// A process-owned anonymous mapping per pool, placed before first touch.
    Anonymous(AnonymousMemory),
}

/// Placement of an anonymous pool mapping.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AnonymousMemory {
    /// Transparent huge pages.
    pub huge_pages: HugePages,
    /// A NUMA memory policy for the mapping (`None`: the process's policy).
    pub numa: Option<NumaBinding>,
}

/// Whether to ask for transparent huge pages (`madvise(MADV_HUGEPAGE)`;
/// THP is in `madvise` mode on these hosts, so nothing happens without it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Do not ask.
    #[default]
    Off,
    /// Ask; if the kernel cannot give them, record a downgrade and go on.
    Prefer,
    /// Ask; if the kernel cannot give them, fail startup.
    Require,
}

/// A NUMA policy for a pool mapping (`mbind` before the first touch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaBinding {
    /// The policy.
    pub mode: NumaMode,
    /// Node ids (each must be online; at most [`MAX_NUMA_NODE`]).
    pub nodes: Vec<u16>,
}

/// Highest node id a binding may name.
pub const MAX_NUMA_NODE: u16 = 1023;

/// `mbind` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumaMode {
    /// `MPOL_BIND`: pages only on these nodes.
    Bind,
    /// `MPOL_PREFERRED`: the (one) node first, others when it is full.
    Preferred,
    /// `MPOL_INTERLEAVE`: pages round-robin over the nodes.
    Interleave,
}

impl NumaMode {
    /// The kernel's `MPOL_*` value.
    pub fn mpol(self) -> i32 {
        match self {
            Self::Bind => libc::MPOL_BIND,
            Self::Preferred => libc::MPOL_PREFERRED,
            Self::Interleave => libc::MPOL_INTERLEAVE,
        }
    }
}

/// Something asked for that the kernel did not give, and startup went on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlacementDowngrade {
    /// Huge pages were preferred but cannot be had (the reason says why).
    HugePages(&'static str),
}

/// What placing one pool did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PlacementOutcome {
    /// `MADV_HUGEPAGE` was accepted for the mapping.
    pub huge_pages_advised: bool,
    /// The NUMA policy applied (`None`: none asked).
    pub numa: Option<NumaBinding>,
    /// What was asked for and not given.
    pub downgrades: Vec<PlacementDowngrade>,
}

/// One pool's memory as the runner holds it (for audits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMemoryInfo {
    /// Pool name.
    pub name: String,
    /// First byte.
    pub base: u64,
    /// Bytes.
    pub len: u64,
    /// Placement result (`None` for [`PoolMemory::Default`]).
    pub placement: Option<PlacementOutcome>,
    /// Bytes of the pool this process had mapped with transparent huge pages
    /// when the runner started (`/proc/self/smaps`; 0 when it cannot tell).
    /// A peer-mode default pool has them where the host allows shared memory
    /// huge pages ([`shared_memory_huge_pages`]); an anonymous one where
    /// [`HugePages`] asked and the kernel gave them.
    pub huge_page_bytes: u64,
}

/// The transparent-huge-page size on x86-64.
pub const HUGE_PAGE: usize = 2 << 20;
/// `mbind`'s nodemask: 1024 bits.
pub(crate) const MASK_WORDS: usize = (MAX_NUMA_NODE as usize + 1) / 64;

/// Parses a sysfs node list (`0`, `0-3,5`).
pub fn parse_node_list(text: &str) -> Option<Vec<u16>> {
    let mut nodes = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi): (u16, u16) = (lo.parse().ok()?, hi.parse().ok()?);
                if lo > hi || hi > MAX_NUMA_NODE {
                    return None;
                }
                nodes.extend(lo..=hi);
            }
            None => nodes.push(part.parse().ok()?),
        }
    }
    Some(nodes)
}

/// The online NUMA nodes (`/sys/devices/system/node/online`); a kernel
/// without NUMA support has no such file and one node, 0.
pub fn online_nodes() -> Vec<u16> {
    std::fs::read_to_string("/sys/devices/system/node/online")
        .ok()
        .and_then(|t| parse_node_list(&t))
        .unwrap_or_else(|| vec![0])
}

/// The THP mode (`always`, `madvise` or `never`), if the kernel has THP.
pub fn transparent_huge_page_mode() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    bracketed(&text).map(str::to_owned)
}

/// Whether the kernel may give shared memory (a peer-mode pool's memfd)
/// transparent huge pages of 2 MiB when a mapping asks: its `shmem_enabled`
/// mode for that size (the per-size knob, or the global one it inherits) is
/// `always`, `within_size`, `advise` or `force`, not `never` or `deny`.
/// `false` when the kernel does not say.
pub fn shared_memory_huge_pages() -> bool {
    const ROOT: &str = "/sys/kernel/mm/transparent_hugepage";
    let mode = |path: &str| {
        let text = std::fs::read_to_string(path).ok()?;
        bracketed(&text).map(str::to_owned)
    };
    let sized = mode(&format!("{ROOT}/hugepages-2048kB/shmem_enabled"));
    let effective = match sized.as_deref() {
        None | Some("inherit") => mode(&format!("{ROOT}/shmem_enabled")),
        Some(_) => sized,
    };
    matches!(
        effective.as_deref(),
        Some("always" | "within_size" | "advise" | "force")
    )
}

/// How many memory mappings this process holds (lines of
/// `/proc/self/maps`), what `vm.max_map_count` bounds.
pub fn mapping_count() -> std::io::Result<usize> {
    use std::io::Read;
    let mut maps = std::fs::File::open("/proc/self/maps")?;
    let mut buffer = vec![0u8; 64 << 10];
    let mut lines = 0;
    loop {
        let read = maps.read(&mut buffer)?;
        if read == 0 {
            return Ok(lines);
        }
        let chunk = buffer.get(..read).unwrap_or_default();
        lines += chunk.iter().filter(|&&b| b == b'\n').count();
    }
}

/// The most mappings a process may hold (`vm.max_map_count`), if the
/// kernel says.
pub fn max_map_count() -> Option<usize> {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The word in brackets, the selected one of a sysfs choice list.
fn bracketed(text: &str) -> Option<&str> {
    let start = text.find('[')?;
    let end = text.get(start..)?.find(']')? + start;
    text.get(start + 1..end)
}

/// For each `(base, len)`, the bytes of `base..base+len` that this process
/// maps with transparent huge pages, summed over the mappings in
/// `/proc/self/smaps` that lie inside the range (`AnonHugePages`,
/// `ShmemPmdMapped`, `FilePmdMapped`); 0 when the file cannot be read. The
/// file is read once for all ranges: reading it walks the page tables of
/// every mapping.
pub fn huge_page_bytes(ranges: &[(u64, u64)]) -> Vec<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    ranges
        .iter()
        .map(|&(base, len)| huge_bytes_in_smaps(&smaps, base, base.saturating_add(len)))
        .collect()
}

fn huge_bytes_in_smaps(smaps: &str, start: u64, end: u64) -> u64 {
    let mut inside = false;
    let mut kib = 0u64;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else {
            continue;
        };
        if let Some((lo, hi)) = first.split_once('-').and_then(|(lo, hi)| {
            Some((
                u64::from_str_radix(lo, 16).ok()?,
                u64::from_str_radix(hi, 16).ok()?,
            ))
        }) {
            // A mapping's header: `lo-hi perms offset dev inode [path]`.
            inside = lo >= start && hi <= end;
        } else if inside
            && matches!(
                first,
                "AnonHugePages:" | "ShmemPmdMapped:" | "FilePmdMapped:"
            )
        {
            kib += fields
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    kib.saturating_mul(1024)
}

/// Validates a binding against the online nodes and builds its nodemask.
pub(crate) fn nodemask(binding: &NumaBinding, online: &[u16]) -> Result<[u64; MASK_WORDS]> {
    if binding.nodes.is_empty() {
        return Err(PoolMemoryReason::NoNodes.into());
    }
    if binding.mode == NumaMode::Preferred && binding.nodes.len() != 1 {
        return Err(PoolMemoryReason::PreferredNeedsOneNode.into());
    }
    let mut mask = [0u64; MASK_WORDS];
    for &node in &binding.nodes {
        if !online.contains(&node) {
            return Err(PoolMemoryReason::NoSuchNode {
                node,
                online: online.to_vec(),
            }
            .into());
        }
        let word = mask
            .get_mut(usize::from(node) / 64)
            .ok_or(PoolMemoryReason::NoSuchNode {
                node,
                online: online.to_vec(),
            })?;
        *word |= 1 << (node % 64);
    }
    Ok(mask)
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SysError;

    const SMAPS: &str = "\
7f0000000000-7f0000800000 rw-s 00000000 00:01 1234 /memfd:kvcr-pool-ab (deleted)
Size:               8192 kB
AnonHugePages:         0 kB
ShmemPmdMapped:     6144 kB
FilePmdMapped:         0 kB
7f0000800000-7f0000a00000 rw-p 00000000 00:00 0
Size:               2048 kB
AnonHugePages:      2048 kB
ShmemPmdMapped:        0 kB
7f0001000000-7f0001200000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
";

    #[rstest::rstest]
    #[case::the_shared_mapping(0x7f00_0000_0000, 0x7f00_0080_0000, 6 << 20)]
    #[case::both_adjacent_mappings(0x7f00_0000_0000, 0x7f00_00a0_0000, 8 << 20)]
    #[case::only_the_anonymous_one(0x7f00_0080_0000, 0x7f00_00a0_0000, 2 << 20)]
    #[case::a_mapping_reaching_past_the_range_counts_not(0x7f00_0000_0000, 0x7f00_0070_0000, 0)]
    #[case::nothing_there(0x1000, 0x2000, 0)]
    fn huge_bytes_count_the_mappings_inside_the_range(
        #[case] start: u64,
        #[case] end: u64,
        #[case] bytes: u64,
    ) {
        assert_eq!(huge_bytes_in_smaps(SMAPS, start, end), bytes);
    }

    #[test]
    fn a_sysfs_choice_is_the_bracketed_word() {
        assert_eq!(
            bracketed("always within_size [advise] never deny force\n"),
            Some("advise")
        );
        assert_eq!(
            bracketed("always [inherit] within_size advise never"),
            Some("inherit")
        );
        assert_eq!(bracketed("always madvise never"), None);
        assert_eq!(bracketed("[never"), None);
    }

    #[test]
    fn node_lists_parse_as_sysfs_writes_them() {
        assert_eq!(parse_node_list("0\n"), Some(vec![0]));
        assert_eq!(parse_node_list("0-2,5"), Some(vec![0, 1, 2, 5]));
        assert_eq!(parse_node_list("3-1"), None);
        assert_eq!(parse_node_list("x"), None);
        assert_eq!(parse_node_list("0-5000"), None);
    }

    #[test]
    fn a_node_that_is_not_online_is_refused_before_mapping() {
        let binding = NumaBinding {
            mode: NumaMode::Bind,
            nodes: vec![7],
        };
        let err = nodemask(&binding, &[0]).unwrap_err();
        assert_eq!(
            err,
            SysError::PoolMemory(PoolMemoryReason::NoSuchNode {
                node: 7,
                online: vec![0]
            })
        );
        let preferred_two = NumaBinding {
            mode: NumaMode::Preferred,
            nodes: vec![0, 1],
        };
        assert!(nodemask(&preferred_two, &[0, 1]).is_err());
        let mask = nodemask(
            &NumaBinding {
                mode: NumaMode::Interleave,
                nodes: vec![0, 65],
            },
            &[0, 65],
        )
        .unwrap();
        assert_eq!((mask[0], mask[1]), (1, 2));
    }
}
