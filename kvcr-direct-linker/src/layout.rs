//! The engine's GPU KV pool as the linker sees it: layer-first, one K and one
//! V buffer per layer, each an array of `device_pages` page slots. A page is
//! therefore `2 × layers` scattered spans, in the order L0.K, L0.V, L1.K, …;
//! in KVCR DRAM each span takes one slot of the runner's `kv` pool.

use kvcr_foundation::runner::{MAX_REGION_ELEMENTS, MAX_SPANS_PER_KEY, RegionDesc};

use crate::error::{Error, Result};

/// Name of the runner pool that holds the spans.
pub const POOL: &str = "kv";

/// One rank's layer-first device KV pool. With tensor parallelism each rank
/// holds `kv_heads` = its share of the model's KV heads, and its own layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// KV heads this rank holds.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: u32,
    /// Page slots in every layer buffer.
    pub device_pages: u32,
    /// This rank's tensor-parallel index (which shard of the heads it holds).
    pub tp_rank: u32,
    /// Tensor-parallel ranks of the engine (1 without TP).
    pub tp_size: u32,
    /// Address of layer `l`'s K buffer (device memory, or host memory for a
    /// host-resident pool).
    pub k_bases: Vec<u64>,
    /// Address of layer `l`'s V buffer.
    pub v_bases: Vec<u64>,
}

fn bad(field: &'static str, why: &'static str) -> Error {
    Error::Layout { field, why }
}

impl KvLayout {
    /// Bytes of one span (one page of one layer's K or V).
    pub fn span_bytes(&self) -> u64 {
        u64::from(self.page_tokens)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    /// Spans per page (`2 × layers`).
    pub fn spans_per_page(&self) -> usize {
        2 * self.layers as usize
    }

    /// Bytes of one page (all layers, K and V).
    pub fn page_bytes(&self) -> u64 {
        self.span_bytes() * self.spans_per_page() as u64
    }

    /// Checks every bound; the copy kernel moves 16-byte vectors, so spans
    /// and buffers must be 16-byte aligned.
    pub fn validate(&self) -> Result<()> {
        if self.layers == 0 || self.spans_per_page() > MAX_SPANS_PER_KEY {
            return Err(bad("layers", "must be in 1..=256"));
        }
        if self.page_tokens == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return Err(bad(
                "geometry",
                "page_tokens, kv_heads and head_dim must be positive",
            ));
        }
        if !matches!(self.dtype_bytes, 1 | 2 | 4) {
            return Err(bad("dtype_bytes", "must be 1, 2 or 4"));
        }
        if !self.span_bytes().is_multiple_of(16) {
            return Err(bad("geometry", "a span must be a multiple of 16 bytes"));
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return Err(bad(
                "tp_rank",
                "must be below tp_size (which must be positive)",
            ));
        }
        if self.device_pages == 0 || u64::from(self.device_pages) > MAX_REGION_ELEMENTS {
            return Err(bad("device_pages", "must be in 1..=2^31"));
        }
        if self.k_bases.len() != self.layers as usize || self.v_bases.len() != self.layers as usize
        {
            return Err(bad("k_bases/v_bases", "need one address per layer"));
        }
        let extent = self
            .span_bytes()
            .checked_mul(u64::from(self.device_pages))
            .ok_or_else(|| bad("device_pages", "overflows the address space"))?;
        for base in self.k_bases.iter().chain(&self.v_bases) {
            if *base == 0 || !base.is_multiple_of(16) {
                return Err(bad(
                    "k_bases/v_bases",
                    "must be non-null and 16-byte aligned",
                ));
            }
            if base.checked_add(extent).is_none() {
                return Err(bad("k_bases/v_bases", "buffer overflows the address space"));
            }
        }
        Ok(())
    }

    /// The framework regions, one per span index (L0.K, L0.V, L1.K, …).
    pub(crate) fn regions(&self) -> Vec<RegionDesc> {
        self.k_bases
            .iter()
            .zip(&self.v_bases)
            .enumerate()
            .flat_map(|(layer, (k, v))| {
                [(k, 'K'), (v, 'V')].map(|(base, part)| RegionDesc {
                    label: format!("{POOL}:L{layer}{part}"),
                    base: *base,
                    size: self.span_bytes(),
                    stride: 0,
                    count: u64::from(self.device_pages),
                })
            })
            .collect()
    }
}
