//! Engine host-pool layouts and their span plans (pure: no I/O, no memory
//! access).
//!
//! An MHA host pool stacks K and V on dimension 0. Per layout (`T` token slots,
//! `L` layers, `H` KV heads held by this rank, `D` head dim, `P` tokens per page,
//! `N = T / P` pages):
//!
//! | layout | dims | spans per page |
//! |---|---|---|
//! | `layer_first` | `(2, L, T, H, D)` | `2 * L` (one per K/V and layer) |
//! | `page_first` | `(2, T, L, H, D)` | 2 (K and V, each `P*L*H*D` elements) |
//! | `page_first_direct` | `(2, N, L, P, H, D)` | 2 |
//! | `page_head` | `(2, N, H, P, L, D)` | 2 |
//!
//! Every span kind becomes one registered strided region (one element per host
//! page), so a page is a list of `(region, page index)` element references.
//! The three 2-span layouts share a span structure but not their bytes' order,
//! so the layout is part of every page's namespace: pages of different layouts
//! never mix.
//!
//! A key carries at most [`MAX_SPANS_PER_KEY`] spans; a page with more (a
//! `layer_first` pool with more than half that many layers) is split into
//! segments, each stored under its own namespace, all of which must be
//! present for a hit.

use std::fmt;
use std::str::FromStr;

use kvcr_foundation::runner::{MAX_REGION_ELEMENTS, MAX_SPANS_PER_KEY, RegionDesc};

use crate::error::{Error, Result};

/// How the engine's host pool orders its KV bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HostLayout {
    /// `(2, layers, tokens, heads, head_dim)`.
    LayerFirst,
    /// `(2, tokens, layers, heads, head_dim)`.
    PageFirst,
    /// `(2, pages, layers, page_size, heads, head_dim)`.
    PageFirstDirect,
    /// `(2, pages, heads, page_size, layers, head_dim)`.
    PageHead,
}

impl HostLayout {
    /// Every layout, in a fixed order.
    pub const ALL: [Self; 4] = [
        Self::LayerFirst,
        Self::PageFirst,
        Self::PageFirstDirect,
        Self::PageHead,
    ];

    /// The engine's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LayerFirst => "layer_first",
            Self::PageFirst => "page_first",
            Self::PageFirstDirect => "page_first_direct",
            Self::PageHead => "page_head",
        }
    }
}

impl fmt::Display for HostLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HostLayout {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|l| l.as_str() == s)
            .ok_or_else(|| Error::HostPool(format!("unknown layout {s:?}")))
    }
}

/// The model geometry one rank's host pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    /// Transformer layers.
    pub layers: u32,
    /// KV heads held by this rank (the model's KV heads / TP size).
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: u32,
    /// Tokens per page.
    pub page_size: u32,
}

impl KvGeometry {
    /// Qwen3-0.6B (28 layers, 8 KV heads, head dim 128, bf16), this rank's
    /// share under `tp_size`, with 64-token pages.
    pub fn qwen3_0_6b(tp_size: u32) -> Self {
        Self {
            layers: 28,
            kv_heads: 8 / tp_size.max(1),
            head_dim: 128,
            dtype_bytes: 2,
            page_size: 64,
        }
    }

    /// Qwen3-32B (64 layers, 8 KV heads, head dim 128, bf16), this rank's
    /// share under `tp_size`, with 64-token pages.
    pub fn qwen3_32b(tp_size: u32) -> Self {
        Self {
            layers: 64,
            ..Self::qwen3_0_6b(tp_size)
        }
    }

    /// Bytes of K (or V) of one token in one layer.
    fn token_layer_bytes(&self) -> Option<u64> {
        u64::from(self.kv_heads)
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(u64::from(self.dtype_bytes))
    }

    /// Bytes of one page, K and V of every layer (this rank's heads).
    pub fn page_bytes(&self) -> u64 {
        self.token_layer_bytes()
            .and_then(|b| b.checked_mul(u64::from(self.layers)))
            .and_then(|b| b.checked_mul(u64::from(self.page_size)))
            .and_then(|b| b.checked_mul(2))
            .unwrap_or(u64::MAX)
    }
}

/// One engine host pool as the engine registers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostPoolDesc {
    /// Byte order of the buffer.
    pub layout: HostLayout,
    /// Address of the buffer (K half first, then V).
    pub base: u64,
    /// Length of the buffer in bytes (must be exactly K and V of every page).
    pub len: u64,
    /// Pages the pool holds (`size_tokens / page_size`).
    pub pages: u64,
    /// The geometry.
    pub geometry: KvGeometry,
}

impl HostPoolDesc {
    /// The buffer length a pool of `pages` pages of `geometry` needs.
    pub fn required_len(geometry: &KvGeometry, pages: u64) -> Option<u64> {
        geometry.page_bytes().checked_mul(pages)
    }
}

/// One span kind of a page: which K/V half and (for `layer_first`) layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanKind {
    /// The region label (`kv:k`, `kv:v`, `kv:k3`, ...).
    pub label: String,
    /// Offset of page 0's span from the buffer base.
    pub offset: u64,
}

/// How a host pool maps to registered regions and per-page span lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanPlan {
    /// The layout.
    pub layout: HostLayout,
    /// Bytes of every span (the KVCR pool's block size).
    pub span_bytes: u64,
    /// Bytes between a span of page `p` and the same span of page `p + 1`.
    pub page_stride: u64,
    /// Host pages.
    pub pages: u64,
    /// The span kinds, in span order.
    pub kinds: Vec<SpanKind>,
    /// Span index ranges stored under one key each (at most
    /// [`MAX_SPANS_PER_KEY`] spans per segment).
    pub segments: Vec<std::ops::Range<usize>>,
}

/// The KVCR pool name host regions are labelled with.
pub const POOL_NAME: &str = "kv";

impl SpanPlan {
    /// Validates `desc` and plans its regions.
    pub fn new(desc: &HostPoolDesc) -> Result<Self> {
        let g = &desc.geometry;
        let bad = |why: &str| Error::HostPool(why.to_owned());
        if g.layers == 0 || g.kv_heads == 0 || g.head_dim == 0 || g.dtype_bytes == 0 {
            return Err(bad(
                "layers, kv_heads, head_dim and dtype_bytes must be positive",
            ));
        }
        if g.page_size == 0 {
            return Err(bad("page_size must be positive"));
        }
        if desc.pages == 0 || desc.pages > MAX_REGION_ELEMENTS {
            return Err(bad("pages must be in 1..=2^31"));
        }
        if desc.base == 0 {
            return Err(bad("base address is null"));
        }
        if desc.len == 0 {
            return Err(bad("pool size is zero"));
        }
        let tlb = g
            .token_layer_bytes()
            .ok_or_else(|| bad("geometry overflows"))?;
        let page_bytes = g.page_bytes();
        let required = HostPoolDesc::required_len(g, desc.pages)
            .ok_or_else(|| bad("pool size overflows 64 bits"))?;
        if desc.len != required {
            return Err(Error::HostPool(format!(
                "buffer is {} bytes; {} pages of this geometry need {required}",
                desc.len, desc.pages
            )));
        }
        if desc.base.checked_add(desc.len).is_none() {
            return Err(bad("buffer wraps the address space"));
        }
        let half = required / 2;
        let page = u64::from(g.page_size);
        let (span_bytes, page_stride, kinds) = match desc.layout {
            HostLayout::LayerFirst => {
                // Per (kv, layer): T token slots of H*D elements; a page's
                // tokens are P consecutive slots.
                let span = tlb * page;
                let layer_block = tlb * page * desc.pages;
                let kinds = ["k", "v"]
                    .iter()
                    .enumerate()
                    .flat_map(|(kv, name)| {
                        (0..g.layers).map(move |l| SpanKind {
                            label: format!("{POOL_NAME}:{name}{l}"),
                            offset: kv as u64 * half + u64::from(l) * layer_block,
                        })
                    })
                    .collect();
                (span, span, kinds)
            }
            HostLayout::PageFirst | HostLayout::PageFirstDirect | HostLayout::PageHead => {
                let span = page_bytes / 2;
                let kinds = vec![
                    SpanKind {
                        label: format!("{POOL_NAME}:k"),
                        offset: 0,
                    },
                    SpanKind {
                        label: format!("{POOL_NAME}:v"),
                        offset: half,
                    },
                ];
                (span, span, kinds)
            }
        };
        let segments = (0..kinds.len())
            .step_by(MAX_SPANS_PER_KEY)
            .map(|start| start..(start + MAX_SPANS_PER_KEY).min(kinds.len()))
            .collect();
        Ok(Self {
            layout: desc.layout,
            span_bytes,
            page_stride,
            pages: desc.pages,
            kinds,
            segments,
        })
    }

    /// The regions to register, in span order, for a buffer at `base`.
    pub fn regions(&self, base: u64) -> Vec<RegionDesc> {
        self.kinds
            .iter()
            .map(|k| RegionDesc {
                label: k.label.clone(),
                base: base + k.offset,
                size: self.span_bytes,
                stride: self.page_stride,
                count: self.pages,
            })
            .collect()
    }

    /// Spans per page.
    pub fn spans_per_page(&self) -> usize {
        self.kinds.len()
    }

    /// `(offset, len)` of every span of `page` from the buffer base, in span
    /// order (for checks and digests; the runner addresses by element).
    pub fn page_spans(&self, page: u64) -> Vec<(u64, u64)> {
        self.kinds
            .iter()
            .map(|k| (k.offset + page * self.page_stride, self.span_bytes))
            .collect()
    }

    /// Validates the host pages one call names, before anything is copied:
    /// every page exists, every byte of every span of it lies inside the
    /// registered buffer of `pool_len` bytes, and no page is named twice (two
    /// copies into one page would leave only one of them there, and both
    /// would be reported done).
    ///
    /// [`Error::Batch`] for a page outside the pool, [`Error::DuplicateHostPage`]
    /// for a page named twice.
    pub fn check_host_pages(&self, pool_len: u64, pages: &[u64]) -> Result<()> {
        for &page in pages {
            if page >= self.pages {
                return Err(Error::Batch(format!(
                    "host page {page} is outside the pool's {} pages",
                    self.pages
                )));
            }
            let inside = self.kinds.iter().all(|k| {
                page.checked_mul(self.page_stride)
                    .and_then(|at| at.checked_add(k.offset))
                    .and_then(|at| at.checked_add(self.span_bytes))
                    .is_some_and(|end| end <= pool_len)
            });
            if !inside {
                return Err(Error::Batch(format!(
                    "host page {page} runs past the registered buffer of {pool_len} bytes"
                )));
            }
        }
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        if let Some(pair) = sorted.windows(2).find(|w| w.first() == w.get(1)) {
            return Err(Error::DuplicateHostPage(
                pair.first().copied().unwrap_or_default(),
            ));
        }
        Ok(())
    }
}

/// Converts SGLang-style token slot indices (`host_indices`, `page_size` per
/// page, page `i` at `indices[i * page_size]`) to host page indices; every
/// page's first slot must be page-aligned.
pub fn pages_from_token_indices(indices: &[u64], page_size: u32) -> Result<Vec<u64>> {
    let p = usize::try_from(page_size).unwrap_or(0);
    if p == 0 || !indices.len().is_multiple_of(p) {
        return Err(Error::Batch(format!(
            "{} token indices is not a whole number of {page_size}-token pages",
            indices.len()
        )));
    }
    indices
        .iter()
        .step_by(p)
        .map(|&t| {
            if t.is_multiple_of(u64::from(page_size)) {
                Ok(t / u64::from(page_size))
            } else {
                Err(Error::Batch(format!("token index {t} is not page-aligned")))
            }
        })
        .collect()
}
