//! Fixed page layouts as descriptor lists (for plans, tests and benches).

use kvcr_foundation::tier::Owner;

use crate::coalesce::{Descriptor, Direction, Location};

/// KV geometry of one page on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageGeometry {
    /// Transformer layers.
    pub layers: u64,
    /// KV heads on this rank.
    pub kv_heads: u64,
    /// Head dimension.
    pub head_dim: u64,
    /// Bytes per element.
    pub dtype_bytes: u64,
    /// Tokens per page.
    pub page_tokens: u64,
}

impl PageGeometry {
    /// Qwen3-0.6B (28 layers, 8 KV heads, head dim 128, bf16), 64-token pages.
    pub const QWEN3_0_6B: Self = Self {
        layers: 28,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        page_tokens: 64,
    };

    /// Bytes of K (or of V) of one page: in a `page_first` host pool
    /// `(2, tokens, layers, heads, dim)` this is one contiguous run.
    pub fn run_bytes(&self) -> u64 {
        self.page_tokens * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes
    }
}

/// Where a page's K and V live on each side of a `page_first` restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageFirstPage {
    /// Page index in the host pool.
    pub host_page: u64,
    /// (KVCR region, slot index) holding K.
    pub k_slot: (u32, u64),
    /// (KVCR region, slot index) holding V.
    pub v_slot: (u32, u64),
}

/// The descriptors of a restore from KVCR DRAM slots into a `page_first`
/// host pool registered as region `host_region` of `host_pages` pages (K half
/// first, V half after it): two per page, K then V, in page order.
pub fn page_first_restore(
    geometry: PageGeometry,
    host_region: u32,
    host_pages: u64,
    pages: &[PageFirstPage],
) -> Vec<Descriptor> {
    let run = geometry.run_bytes();
    let v_base = host_pages * run;
    let one = |(region, slot): (u32, u64), dst: u64| Descriptor {
        owner: Owner::Kvcr,
        direction: Direction::Restore,
        src: Location {
            region,
            offset: slot * run,
        },
        dst: Location {
            region: host_region,
            offset: dst,
        },
        len: run,
    };
    pages
        .iter()
        .flat_map(|p| {
            [
                one(p.k_slot, p.host_page * run),
                one(p.v_slot, v_base + p.host_page * run),
            ]
        })
        .collect()
}
