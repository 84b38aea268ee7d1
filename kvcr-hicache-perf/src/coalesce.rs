//! Descriptor coalescing as a pure planner.
//!
//! A *descriptor* is one span a transfer moves: `len` bytes from a source
//! (registered region, offset) to a destination (region, offset), in one
//! direction, on behalf of one owner. Adjacent descriptors merge into one
//! transfer when they share the owner, the direction, the source region and
//! the destination region, and are contiguous on **both** sides; they never
//! merge across owners or regions. The plan moves exactly the bytes the
//! descriptors name (a property test checks it), and each transfer lists the
//! descriptors it carries, so a failed transfer fails exactly their pages.
//!
//! No I/O, no clock, no unsafe: the planner only reorders and merges.

use kvcr_foundation::tier::Owner;

/// Which way a transfer moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// KVCR DRAM → engine memory (a restore).
    Restore,
    /// Engine memory → KVCR DRAM (an offload).
    Offload,
    /// A peer's KVCR DRAM → this runner's KVCR DRAM.
    PeerFetch,
}

/// A place in a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Location {
    /// The registered region (the runner's region id).
    pub region: u32,
    /// Byte offset inside it.
    pub offset: u64,
}

/// One span to move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    /// Whose memory the page is accounted to.
    pub owner: Owner,
    /// Direction.
    pub direction: Direction,
    /// Source.
    pub src: Location,
    /// Destination.
    pub dst: Location,
    /// Bytes.
    pub len: u64,
}

/// One transfer of a plan: one or more merged descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Owner of every descriptor merged here.
    pub owner: Owner,
    /// Direction of every descriptor merged here.
    pub direction: Direction,
    /// Source start.
    pub src: Location,
    /// Destination start.
    pub dst: Location,
    /// Bytes.
    pub len: u64,
    /// Indices (into the planned descriptors) carried by this transfer, in
    /// offset order.
    pub parts: Vec<usize>,
}

/// What the planner may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CoalesceOptions {
    /// Merge adjacent descriptors (off: one transfer per descriptor, in the
    /// given order — the base path's plan).
    pub enabled: bool,
    /// Largest merged transfer in bytes (0: unbounded). A descriptor larger
    /// than this is never cut; it just is not merged with others.
    pub max_transfer_bytes: u64,
}

impl CoalesceOptions {
    /// Coalescing on, unbounded.
    pub fn on() -> Self {
        Self {
            enabled: true,
            max_transfer_bytes: 0,
        }
    }
}

/// A transfer plan.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// The transfers, in execution order.
    pub transfers: Vec<Transfer>,
}

impl Plan {
    /// Transfer operations in the plan.
    pub fn ops(&self) -> usize {
        self.transfers.len()
    }

    /// Bytes the plan moves.
    pub fn bytes(&self) -> u64 {
        self.transfers.iter().map(|t| t.len).sum()
    }

    /// A stable text rendering (one transfer per line) for snapshots and logs.
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        for (i, t) in self.transfers.iter().enumerate() {
            let _ = writeln!(
                out,
                "{i}: {:?} {:?} r{}+{} -> r{}+{} len {} parts {:?}",
                t.owner,
                t.direction,
                t.src.region,
                t.src.offset,
                t.dst.region,
                t.dst.offset,
                t.len,
                t.parts
            );
        }
        out
    }
}

/// Plans `descriptors`. With coalescing off the plan is one transfer per
/// descriptor in the given order; with it on, descriptors are grouped by
/// (owner, direction, source region, destination region), ordered by source
/// offset, and contiguous neighbours merge.
pub fn plan(descriptors: &[Descriptor], options: CoalesceOptions) -> Plan {
    let single = |(i, d): (usize, &Descriptor)| Transfer {
        owner: d.owner,
        direction: d.direction,
        src: d.src,
        dst: d.dst,
        len: d.len,
        parts: vec![i],
    };
    if !options.enabled {
        return Plan {
            transfers: descriptors.iter().enumerate().map(single).collect(),
        };
    }
    let mut order: Vec<(usize, &Descriptor)> = descriptors.iter().enumerate().collect();
    order.sort_by_key(|(i, d)| {
        (
            d.owner,
            d.direction,
            d.src.region,
            d.dst.region,
            d.src.offset,
            d.dst.offset,
            *i,
        )
    });
    let mut transfers: Vec<Transfer> = Vec::with_capacity(order.len());
    for (i, d) in order {
        if let Some(last) = transfers.last_mut()
            && mergeable(last, d, options.max_transfer_bytes)
        {
            last.len += d.len;
            last.parts.push(i);
            continue;
        }
        transfers.push(single((i, d)));
    }
    Plan { transfers }
}

fn mergeable(last: &Transfer, d: &Descriptor, cap: u64) -> bool {
    last.owner == d.owner
        && last.direction == d.direction
        && last.src.region == d.src.region
        && last.dst.region == d.dst.region
        && d.len > 0
        && last.len > 0
        && last.src.offset.checked_add(last.len) == Some(d.src.offset)
        && last.dst.offset.checked_add(last.len) == Some(d.dst.offset)
        && (cap == 0 || last.len.checked_add(d.len).is_some_and(|n| n <= cap))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(owner: Owner, src: (u32, u64), dst: (u32, u64), len: u64) -> Descriptor {
        Descriptor {
            owner,
            direction: Direction::Restore,
            src: Location {
                region: src.0,
                offset: src.1,
            },
            dst: Location {
                region: dst.0,
                offset: dst.1,
            },
            len,
        }
    }

    /// Every byte a plan moves: (owner, direction, src region, src byte, dst region, dst byte).
    fn bytes_moved(plan: &Plan) -> Vec<(Owner, Direction, u32, u64, u32, u64)> {
        let mut out: Vec<_> = plan
            .transfers
            .iter()
            .flat_map(|t| {
                (0..t.len).map(move |b| {
                    (
                        t.owner,
                        t.direction,
                        t.src.region,
                        t.src.offset + b,
                        t.dst.region,
                        t.dst.offset + b,
                    )
                })
            })
            .collect();
        out.sort_unstable();
        out
    }

    fn descriptor() -> impl Strategy<Value = Descriptor> {
        (
            prop::bool::ANY,
            0u8..3,
            0u32..2,
            0u64..12,
            0u32..2,
            0u64..12,
            0u64..4,
        )
            .prop_map(|(kvcr, dir, sr, so, dr, dof, len)| Descriptor {
                owner: if kvcr { Owner::Kvcr } else { Owner::Framework },
                direction: match dir {
                    0 => Direction::Restore,
                    1 => Direction::Offload,
                    _ => Direction::PeerFetch,
                },
                // Offsets on a grid of 4 so that adjacency is common.
                src: Location {
                    region: sr,
                    offset: so * 4,
                },
                dst: Location {
                    region: dr,
                    offset: dof * 4,
                },
                len: if len == 3 { 4 } else { len },
            })
    }

    proptest! {
        #[test]
        fn a_coalesced_plan_moves_exactly_the_bytes_of_the_uncoalesced_one(
            descriptors in prop::collection::vec(descriptor(), 0..40),
            cap in prop::sample::select(vec![0u64, 4, 8, 12]),
        ) {
            let base = plan(&descriptors, CoalesceOptions::default());
            let merged = plan(&descriptors, CoalesceOptions { enabled: true, max_transfer_bytes: cap });
            prop_assert_eq!(bytes_moved(&base), bytes_moved(&merged));
            prop_assert!(merged.ops() <= base.ops());
            // Parts partition the descriptors, and every part agrees with its
            // transfer on owner, direction and both regions.
            let mut seen: Vec<usize> = merged.transfers.iter().flat_map(|t| t.parts.clone()).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..descriptors.len()).collect::<Vec<_>>());
            for t in &merged.transfers {
                let mut at = (t.src.offset, t.dst.offset);
                for &p in &t.parts {
                    let d = descriptors[p];
                    prop_assert_eq!((d.owner, d.direction, d.src.region, d.dst.region),
                        (t.owner, t.direction, t.src.region, t.dst.region));
                    prop_assert_eq!((d.src.offset, d.dst.offset), at);
                    at = (at.0 + d.len, at.1 + d.len);
                }
                prop_assert_eq!(at.0 - t.src.offset, t.len);
                if cap > 0 && t.parts.len() > 1 {
                    prop_assert!(t.len <= cap);
                }
            }
        }
    }

    #[test]
    fn coalescing_off_is_one_transfer_per_descriptor_in_order() {
        let ds = [
            d(Owner::Kvcr, (0, 8), (1, 8), 8),
            d(Owner::Kvcr, (0, 0), (1, 0), 8),
        ];
        let p = plan(&ds, CoalesceOptions::default());
        assert_eq!(p.ops(), 2);
        assert_eq!(p.transfers[0].parts, vec![0]);
        assert_eq!(p.transfers[1].src.offset, 0);
    }

    #[test]
    fn never_merges_across_owners_or_regions_even_when_contiguous() {
        let ds = [
            d(Owner::Kvcr, (0, 0), (1, 0), 8),
            d(Owner::Framework, (0, 8), (1, 8), 8),
            d(Owner::Kvcr, (0, 16), (2, 16), 8),
            d(Owner::Kvcr, (3, 24), (1, 24), 8),
        ];
        assert_eq!(plan(&ds, CoalesceOptions::on()).ops(), 4);
    }

    #[test]
    fn contiguous_on_one_side_only_does_not_merge() {
        let ds = [
            d(Owner::Kvcr, (0, 0), (1, 0), 8),
            d(Owner::Kvcr, (0, 8), (1, 100), 8),
        ];
        assert_eq!(plan(&ds, CoalesceOptions::on()).ops(), 2);
    }
}
