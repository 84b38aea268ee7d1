//! Whether a host pool's bytes are mapped in this process, readable and
//! writable: checked once, when the pool is registered, from
//! `/proc/self/maps` (a file read; no unsafe code, no memory is touched).
//!
//! Why `/proc/self/maps` and not `mincore(2)`: `mincore` only says whether a
//! range is mapped, not with which permissions (a `PROT_NONE` or read-only
//! mapping passes it), and it needs an unsafe system call; the maps file gives
//! both facts in one read.
//!
//! What this proves and what it cannot:
//! * a base that names nothing (a stale or made-up address), a range that
//!   runs past the end of its mapping or across a hole, and a read-only or
//!   inaccessible mapping are refused at registration, before the runner
//!   copies a byte, with the first offending address named;
//! * it is a snapshot: memory the engine unmaps (or `mprotect`s) after
//!   registration, or replaces with another mapping at the same address, is
//!   beyond any check the backend can make without a system call per copy.
//!   That stays the engine's promise, stated on
//!   [`crate::KvcrHiCacheStorage::register_host_pool`]: the pool outlives the
//!   backend;
//! * it cannot tell whose memory a mapped range is: a pool that overlaps
//!   another object of the process (an address that is mapped, but not the
//!   engine's pool) is the engine's lie to keep;
//! * when the file cannot be read (no `/proc`), registration is refused
//!   rather than served unchecked.
//!
//! A line that does not parse is skipped: that can only leave a hole in the
//! coverage, so it can refuse a pool but never accept one.

use crate::error::{Error, Result};

/// Where the kernel lists this process's mappings.
const MAPS: &str = "/proc/self/maps";

/// One line of the maps file: `start-end perms offset dev inode [path]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mapping {
    start: u64,
    end: u64,
    read: bool,
    write: bool,
}

impl Mapping {
    fn parse(line: &str) -> Option<Self> {
        let mut fields = line.split_ascii_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let perms = fields.next()?.as_bytes();
        let start = u64::from_str_radix(start, 16).ok()?;
        let end = u64::from_str_radix(end, 16).ok()?;
        if end <= start || perms.len() < 2 {
            return None;
        }
        Some(Self {
            start,
            end,
            read: perms.first() == Some(&b'r'),
            write: perms.get(1) == Some(&b'w'),
        })
    }
}

/// Refuses `base .. base + len` unless this process maps every byte of it
/// readable and writable now (read from `/proc/self/maps`).
pub(crate) fn check_host_memory(base: u64, len: u64) -> Result<()> {
    let maps = std::fs::read_to_string(MAPS).map_err(|e| {
        Error::HostPool(format!(
            "cannot check that the pool's memory is mapped (reading {MAPS}: {e})"
        ))
    })?;
    check_mapped_rw(&maps, base, len)
}

/// Refuses `base .. base + len` unless the mappings listed in `maps` (the
/// text of a `/proc/<pid>/maps` file) cover every byte of it, readable and
/// writable.
pub(crate) fn check_mapped_rw(maps: &str, base: u64, len: u64) -> Result<()> {
    if len == 0 {
        return Err(Error::HostPool("pool size is zero".into()));
    }
    let end = base
        .checked_add(len)
        .ok_or_else(|| Error::HostPool("buffer wraps the address space".into()))?;
    let mut mappings: Vec<Mapping> = maps.lines().filter_map(Mapping::parse).collect();
    mappings.sort_unstable_by_key(|m| m.start);
    let mut cursor = base;
    for m in mappings {
        if m.end <= cursor {
            continue;
        }
        if m.start > cursor {
            break;
        }
        if !(m.read && m.write) {
            return Err(Error::HostPool(format!(
                "pool memory at {cursor:#x} (pool {base:#x}, {len} bytes) is mapped without \
                 read and write permission"
            )));
        }
        cursor = m.end;
        if cursor >= end {
            return Ok(());
        }
    }
    Err(Error::HostPool(format!(
        "pool memory at {cursor:#x} (pool {base:#x}, {len} bytes) is not mapped in this process"
    )))
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    /// Three mappings: rw `0x10000..0x13000`, then rw `0x13000..0x14000`
    /// (adjacent), a hole, read-only `0x20000..0x21000`, rw `0x21000..0x22000`,
    /// and a line that does not parse.
    const MAPS_TEXT: &str = "\
00010000-00013000 rw-p 00000000 00:00 0                          [heap]
00013000-00014000 rw-p 00000000 00:00 0
00020000-00021000 r--p 00000000 08:01 1234                       /usr/lib/libx.so
00021000-00022000 rw-p 00001000 08:01 1234                       /usr/lib/libx.so
this line is not a mapping
00030000-00031000 ---p 00000000 00:00 0
";

    #[rstest]
    #[case::inside_one(0x10000, 0x1000, None)]
    #[case::exactly_one(0x10000, 0x3000, None)]
    #[case::across_adjacent(0x12000, 0x2000, None)]
    #[case::to_the_last_byte(0x13fff, 1, None)]
    #[case::one_byte_past(0x13fff, 2, Some("0x14000 (pool 0x13fff, 2 bytes) is not mapped"))]
    #[case::before_everything(0x1000, 0x100, Some("0x1000 (pool 0x1000, 256 bytes) is not mapped"))]
    #[case::in_the_hole(0x15000, 0x10, Some("is not mapped"))]
    #[case::read_only(
        0x20000,
        0x10,
        Some("0x20000 (pool 0x20000, 16 bytes) is mapped without")
    )]
    #[case::runs_into_read_only(0x13000, 0x10000, Some("0x14000"))]
    #[case::rw_after_read_only(0x21000, 0x1000, None)]
    #[case::no_access(0x30000, 0x10, Some("mapped without read and write"))]
    #[case::kernel_half(0xffff_8000_0000_0000, 0x1000, Some("is not mapped"))]
    #[case::zero(0x10000, 0, Some("pool size is zero"))]
    #[case::wraps(u64::MAX - 4, 0x10, Some("wraps"))]
    fn mapped_rw_coverage(#[case] base: u64, #[case] len: u64, #[case] refused: Option<&str>) {
        match (check_mapped_rw(MAPS_TEXT, base, len), refused) {
            (Ok(()), None) => {}
            (Err(Error::HostPool(why)), Some(want)) => assert!(why.contains(want), "{why}"),
            (other, _) => panic!("{base:#x}+{len}: {other:?}"),
        }
    }

    #[test]
    fn unsorted_lines_are_sorted_first() {
        let maps = "00002000-00003000 rw-p 0 0 0\n00001000-00002000 rw-p 0 0 0\n";
        check_mapped_rw(maps, 0x1000, 0x2000).unwrap();
    }

    /// This process's own memory: a live heap buffer passes, an address below
    /// `vm.mmap_min_addr` (never mapped) and a read-only static are refused.
    #[test]
    fn this_process() {
        let heap = vec![7u8; 3 * 4096];
        check_host_memory(heap.as_ptr() as u64, heap.len() as u64).unwrap();
        let err = check_host_memory(0x1000, 4096).unwrap_err();
        assert!(err.to_string().contains("is not mapped"), "{err}");
        static READ_ONLY: [u8; 3 * 4096] = [1; 3 * 4096];
        let err = check_host_memory(READ_ONLY.as_ptr() as u64, READ_ONLY.len() as u64).unwrap_err();
        assert!(err.to_string().contains("without read and write"), "{err}");
    }
}
