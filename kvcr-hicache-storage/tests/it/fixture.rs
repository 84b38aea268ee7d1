//! Simulated engines: `tp` ranks (threads), each with its own host pool,
//! backend and runner, agreeing through an in-process rank group.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvcr_foundation::{BlockKey, InventoryEvent, InventorySink};
use kvcr_hicache_storage::{
    ExtraInfo, HostLayout, HostPoolDesc, KvGeometry, KvcrHiCacheStorage, LocalRankGroup,
    RankGroups, StorageConfig,
};
use serde_json::{Value, json};

/// A small geometry: 2 layers, 1 KV head per rank, head dim 8, bf16, 4-token
/// pages (256 bytes per page per rank).
pub(crate) fn small_geometry() -> KvGeometry {
    KvGeometry {
        layers: 2,
        kv_heads: 1,
        head_dim: 8,
        dtype_bytes: 2,
        page_size: 4,
    }
}

/// Collects published events.
#[derive(Clone, Default)]
pub(crate) struct Events(pub(crate) Arc<Mutex<Vec<InventoryEvent>>>);

impl InventorySink for Events {
    fn publish(&mut self, event: &InventoryEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

impl Events {
    pub(crate) fn take(&self) -> Vec<InventoryEvent> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    /// Keys of every `Stored` (in order) and every `Removed`.
    pub(crate) fn stored_and_removed(&self) -> (Vec<BlockKey>, Vec<BlockKey>) {
        let mut stored = Vec::new();
        let mut removed = Vec::new();
        for e in self.0.lock().unwrap().iter() {
            match e {
                InventoryEvent::Stored { keys, .. } => stored.extend(keys),
                InventoryEvent::Removed { keys, .. } => removed.extend(keys),
                InventoryEvent::AllCleared { .. } => {}
            }
        }
        (stored, removed)
    }
}

/// One rank: its backend and its host pool. The backend is declared first so
/// it (and its runner) drops before the memory it registered.
pub(crate) struct Rank {
    pub(crate) storage: KvcrHiCacheStorage,
    pub(crate) host: Vec<u8>,
    pub(crate) geometry: KvGeometry,
    pub(crate) layout: HostLayout,
    pub(crate) pages: u64,
}

impl Rank {
    /// The bytes of host page `page` (every span, in span order).
    pub(crate) fn page_bytes(&self, page: u64) -> Vec<u8> {
        let plan = self.storage.span_plan().unwrap();
        plan.page_spans(page)
            .into_iter()
            .flat_map(|(off, len)| self.host[off as usize..(off + len) as usize].to_vec())
            .collect()
    }
}

/// The bytes engine `seed`'s rank `rank` holds for page content `content`.
pub(crate) fn pattern(seed: u64, rank: u32, content: u64, len: usize) -> Vec<u8> {
    let mut x = (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (u64::from(rank) << 48) ^ content) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub(crate) struct Engine {
    pub(crate) ranks: Vec<Rank>,
}

pub(crate) struct EngineSpec {
    pub(crate) tp: u32,
    pub(crate) layout: HostLayout,
    pub(crate) geometry: KvGeometry,
    pub(crate) host_pages: u64,
    pub(crate) extra: Value,
    /// Host page `p` of rank `r` is filled with `pattern(seed, r, p)`; `None`
    /// leaves the pool zeroed.
    pub(crate) fill_seed: Option<u64>,
}

impl EngineSpec {
    pub(crate) fn local(tp: u32, layout: HostLayout, kvcr_pages: u64) -> Self {
        let geometry = small_geometry();
        Self {
            tp,
            layout,
            geometry,
            host_pages: 16,
            extra: json!({
                "local_dram_bytes": kvcr_pages * geometry.page_bytes(),
                "operation_timeout_ms": 5000,
                "get_timeout_s": 10,
                "prefault": false,
            }),
            fill_seed: Some(1),
        }
    }
}

impl Engine {
    pub(crate) fn start(spec: &EngineSpec) -> Self {
        Self::try_start(spec).unwrap()
    }

    pub(crate) fn try_start(spec: &EngineSpec) -> kvcr_hicache_storage::Result<Self> {
        let prefetch = LocalRankGroup::new(spec.tp, Duration::from_secs(30));
        let backup = LocalRankGroup::new(spec.tp, Duration::from_secs(30));
        let mut ranks = Vec::new();
        for (r, (p, b)) in prefetch.into_iter().zip(backup).enumerate() {
            let r = r as u32;
            let config =
                StorageConfig::single_rank("test-model", spec.extra.clone()).with_tp(r, spec.tp);
            let storage = KvcrHiCacheStorage::new(
                config,
                RankGroups {
                    prefetch: Arc::new(p),
                    backup: Arc::new(b),
                },
            )?;
            let len = HostPoolDesc::required_len(&spec.geometry, spec.host_pages).unwrap();
            let mut host = vec![0u8; len as usize];
            let desc = HostPoolDesc {
                layout: spec.layout,
                base: host.as_mut_ptr() as u64,
                len,
                pages: spec.host_pages,
                geometry: spec.geometry,
            };
            // SAFETY: (test) `host` lives in the same `Rank`, after the
            // backend, and is only read between calls.
            unsafe { storage.register_host_pool(desc) }?;
            let mut rank = Rank {
                storage,
                host,
                geometry: spec.geometry,
                layout: spec.layout,
                pages: spec.host_pages,
            };
            if let Some(seed) = spec.fill_seed {
                let plan = rank.storage.span_plan().unwrap().clone();
                for page in 0..spec.host_pages {
                    let spans = plan.page_spans(page);
                    let total: u64 = spans.iter().map(|s| s.1).sum();
                    let bytes = pattern(seed, r, page, total as usize);
                    let mut at = 0;
                    for (off, len) in spans {
                        rank.host[off as usize..(off + len) as usize]
                            .copy_from_slice(&bytes[at..at + len as usize]);
                        at += len as usize;
                    }
                }
            }
            ranks.push(rank);
        }
        Ok(Self { ranks })
    }

    /// Runs `f` on every rank at once (each rank on its own thread, as the
    /// engine's ranks are), results in rank order.
    pub(crate) fn all<T: Send>(&self, f: impl Fn(&Rank) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = self.ranks.iter().map(|r| s.spawn(|| f(r))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    pub(crate) fn set(
        &self,
        keys: &[BlockKey],
        pages: &[u64],
        extra: &ExtraInfo,
    ) -> Vec<Vec<bool>> {
        self.all(|r| r.storage.batch_set(keys, pages, extra))
    }

    pub(crate) fn get(
        &self,
        keys: &[BlockKey],
        pages: &[u64],
        extra: &ExtraInfo,
    ) -> Vec<Vec<bool>> {
        self.all(|r| r.storage.batch_get(keys, pages, extra))
    }

    pub(crate) fn exists(&self, keys: &[BlockKey], extra: &ExtraInfo) -> Vec<usize> {
        self.all(|r| r.storage.batch_exists(keys, extra))
    }
}

pub(crate) fn keys(raw: &[u64]) -> Vec<BlockKey> {
    raw.iter().map(|k| BlockKey::from_u64(*k)).collect()
}

/// Tokens for `n` pages of `page_size`, so `batch_set` can publish them.
pub(crate) fn tokens(n: usize, page_size: u32, parent: Option<BlockKey>) -> ExtraInfo {
    ExtraInfo {
        pages: Some(kvcr_hicache_storage::PageTokens {
            parent,
            token_ids: (0..(n as u32 * page_size)).collect(),
            ..kvcr_hicache_storage::PageTokens::default()
        }),
        ..ExtraInfo::default()
    }
}
