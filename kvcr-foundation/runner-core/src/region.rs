//! Registered regions and their bounds checks (pure, no memory access).
//!
//! A region is a strided array of equally sized elements: element `i` spans
//! `[base + i * stride, base + i * stride + size)`. The framework registers its
//! regions up front (labelled `pool` or `pool:part`, one element = one block of
//! that pool); the runner registers one region per DRAM pool it owns. Every
//! reference the runner accepts is `(region id, element index)`; raw addresses
//! never come in from callers or peers.

use std::collections::HashMap;

use crate::error::{Echo, Error, Result, RunnerReason};
use crate::types::PoolId;
use kvcr_contracts::protocol::{ElementRef, RegionId};
use kvcr_contracts::tier::Owner;

/// Longest region label (as on the wire).
pub const MAX_REGION_LABEL: usize = 64;
/// Most elements in one region.
pub const MAX_REGION_ELEMENTS: u64 = 1 << 31;

/// Where `region` is in `sorted` (ascending by `id_of`), trying first the
/// place after `last` before a binary search: a layer-first page names its
/// regions in order, so a walk over a restore's elements (232,000 for the
/// seed's) nearly always finds each one there.
pub fn position_after<T>(
    sorted: &[T],
    region: RegionId,
    last: Option<usize>,
    id_of: impl Fn(&T) -> RegionId,
) -> Option<usize> {
    let next = last.map_or(0, |l| l + 1);
    match sorted.get(next) {
        Some(item) if id_of(item) == region => Some(next),
        _ => sorted.binary_search_by_key(&region, id_of).ok(),
    }
}

/// A strided region as the framework describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionDesc {
    /// `pool` or `pool:part`; `[A-Za-z0-9_./-]` plus one optional `:`.
    pub label: String,
    /// Address of element 0.
    pub base: u64,
    /// Bytes per element (must equal the pool's block size).
    pub size: u64,
    /// Bytes between elements; 0 means `size` (contiguous).
    pub stride: u64,
    /// Number of elements.
    pub count: u64,
}

impl RegionDesc {
    /// The effective stride.
    pub fn effective_stride(&self) -> u64 {
        if self.stride == 0 {
            self.size
        } else {
            self.stride
        }
    }

    /// One past the last byte, if it fits in 64 bits.
    fn end(&self) -> Option<u64> {
        self.effective_stride()
            .checked_mul(self.count.checked_sub(1)?)?
            .checked_add(self.size)?
            .checked_add(self.base)
    }

    /// The pool name: the label up to the first `:`.
    pub fn pool_name(&self) -> &str {
        self.label.split(':').next().unwrap_or_default()
    }
}

/// Where a framework region's bytes live, which decides who copies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegionMemory {
    /// Host memory the runner's copy thread reads and writes itself.
    Host,
    /// Device memory (a GPU's address in the process's unified address space):
    /// only the runner's `DeviceCopier` (in `kvcr-runner`) touches it.
    Device,
}

#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub(crate) desc: RegionDesc,
    pub(crate) pool: PoolId,
    pub(crate) owner: Owner,
    pub(crate) memory: RegionMemory,
    end: u64,
}

/// A resolved element: where it is and which pool it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) pool: PoolId,
    pub(crate) memory: RegionMemory,
}

/// All registered regions, framework and runner-owned.
#[derive(Debug, Default)]
pub(crate) struct RegionTable {
    regions: Vec<Region>,
    by_label: HashMap<String, RegionId>,
}

fn region_err(label: &str, why: &'static str) -> Error {
    Error::runner(RunnerReason::Region {
        label: Echo::new(label),
        why,
    })
}

impl RegionTable {
    /// Validates and adds a region. `pools` gives (name, block size) per pool
    /// id. Framework regions find their pool by label; a runner-owned pool
    /// region names its pool explicitly (`own_pool`).
    pub(crate) fn register(
        &mut self,
        desc: RegionDesc,
        owner: Owner,
        memory: RegionMemory,
        pools: &[(String, u64)],
        own_pool: Option<usize>,
    ) -> Result<RegionId> {
        let label = desc.label.as_str();
        let colons = label.bytes().filter(|b| *b == b':').count();
        let label_ok = !label.is_empty()
            && label.len() <= MAX_REGION_LABEL
            && colons <= 1
            && !label.starts_with(':')
            && !label.ends_with(':')
            && label.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'-' | b':')
            });
        if !label_ok {
            return Err(region_err(
                label,
                "label must be 1..=64 of [A-Za-z0-9_./-] with at most one inner ':'",
            ));
        }
        if desc.base == 0 {
            return Err(region_err(label, "base address is null"));
        }
        if desc.size == 0 {
            return Err(region_err(label, "element size is zero"));
        }
        if desc.count == 0 || desc.count > MAX_REGION_ELEMENTS {
            return Err(region_err(label, "element count must be in 1..=2^31"));
        }
        if desc.stride != 0 && desc.stride < desc.size {
            return Err(region_err(label, "stride is smaller than the element size"));
        }
        let end = desc
            .end()
            .ok_or_else(|| region_err(label, "extent overflows the address space"))?;
        if self.by_label.contains_key(label) {
            return Err(Error::runner(RunnerReason::DuplicateRegion(Echo::new(
                label,
            ))));
        }
        let pool_name = desc.pool_name();
        let (pool_index, (_, block)) = pools
            .iter()
            .enumerate()
            .find(|(i, (name, _))| own_pool.map_or(name == pool_name, |own| own == *i))
            .ok_or_else(|| Error::runner(RunnerReason::RegionPool(Echo::new(label))))?;
        if desc.size != *block {
            return Err(Error::runner(RunnerReason::RegionSize {
                label: Echo::new(label),
                size: desc.size,
                block: *block,
            }));
        }
        if let Some(other) = self
            .regions
            .iter()
            .find(|r| desc.base < r.end && r.desc.base < end)
        {
            return Err(Error::runner(RunnerReason::RegionOverlap {
                label: Echo::new(label),
                other: Echo::new(&other.desc.label),
            }));
        }
        let id = RegionId(
            u32::try_from(self.regions.len()).map_err(|_| region_err(label, "too many regions"))?,
        );
        let pool =
            PoolId(u16::try_from(pool_index).map_err(|_| region_err(label, "too many pools"))?);
        self.by_label.insert(desc.label.clone(), id);
        self.regions.push(Region {
            desc,
            pool,
            owner,
            memory,
            end,
        });
        Ok(id)
    }

    /// Resolves a reference, checking the region exists and the index is in range.
    pub(crate) fn resolve(&self, element: ElementRef) -> Result<Span> {
        Self::resolve_in(self.get(element.region)?, element)
    }

    /// [`Self::resolve`] in `region`, the one `element` names (a deliver
    /// resolves ~230,000 elements: each region is looked up once).
    fn resolve_in(region: &Region, element: ElementRef) -> Result<Span> {
        if element.index >= region.desc.count {
            return Err(Error::runner(RunnerReason::ElementOutOfRange {
                region: element.region.0,
                index: element.index,
                count: region.desc.count,
            }));
        }
        Ok(Span {
            // In range: index < count and the extent was checked at registration.
            addr: region.desc.base + element.index * region.desc.effective_stride(),
            len: region.desc.size,
            pool: region.pool,
            memory: region.memory,
        })
    }

    /// Resolves a reference that must name framework memory.
    pub(crate) fn resolve_framework(&self, element: ElementRef) -> Result<Span> {
        let region = self.get(element.region)?;
        if region.owner != Owner::Framework {
            return Err(Error::runner(RunnerReason::NotFrameworkRegion(
                element.region.0,
            )));
        }
        Self::resolve_in(region, element)
    }

    pub(crate) fn get(&self, id: RegionId) -> Result<&Region> {
        self.regions
            .get(id.0 as usize)
            .ok_or_else(|| Error::runner(RunnerReason::UnknownRegion(id.0)))
    }

    /// Looks a region up by label.
    pub(crate) fn by_label(&self, label: &str) -> Option<RegionId> {
        self.by_label.get(label).copied()
    }
}
