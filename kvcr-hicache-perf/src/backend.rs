//! The HiCache backend with the performance controls: a thin layer over
//! `kvcr_hicache_storage::KvcrHiCacheStorage` with the same entry points in
//! the same argument order. Options come separately ([`PerfConfig`]); with
//! the default every call goes straight to the storage crate, so results and
//! transfer plans are exactly its own (a test checks it).
//!
//! Batching splits one engine call into several storage calls. Every rank
//! of a tensor-parallel group splits the same keys the same way and each
//! storage call agrees over the group on its own, so the collectives stay
//! in step. Through these synchronous entry points one chunk is in flight
//! at a time; a window of several operations needs the runner itself
//! (`crate::window::deliver_windowed`).

use kvcr_foundation::BlockKey;
use kvcr_hicache_storage::{
    ExtraInfo, HostPoolDesc, KvcrHiCacheStorage, RankGroups, RunnerTuning, StorageConfig,
};

use crate::error::Result;
use crate::window::{DeliveryWindow, WindowLimits, drive};

/// The performance controls; every one is off by default.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PerfConfig {
    /// How the runner backs its pool (default: the runner's own allocation).
    pub pool_memory: kvcr_foundation::runner::PoolMemory,
    /// UCX split sizing of the runner's puts (default: off).
    pub put_split: kvcr_foundation::runner::PutSplit,
    /// Pages per storage `batch_get` call (0: the whole batch in one call).
    pub read_batch_pages: usize,
    /// Bytes of pages per storage `batch_get` call (0: unbounded). A page
    /// larger than this still goes, alone.
    pub read_batch_bytes: u64,
    /// Keys per storage `batch_exists` query (0: all in one). Querying stops
    /// at the first chunk that is not all hits, as the engine's own loop does.
    pub exists_batch_pages: usize,
}

/// The extra-config keys this layer reads (all optional; absent = off).
pub const EXTRA_CONFIG_KEYS: &[&str] = &[
    "perf_read_batch_pages",
    "perf_read_batch_bytes",
    "perf_exists_batch_pages",
    "perf_anonymous_dram",
    "perf_huge_pages",
    "perf_numa_node",
    "perf_numa_mode",
    "perf_put_split_bytes",
    "perf_put_split_in_flight",
];

fn bad(field: &'static str, why: &'static str) -> crate::error::PerfError {
    crate::error::PerfError::Config { field, why }
}

fn count(map: &serde_json::Map<String, serde_json::Value>, key: &'static str) -> Result<u64> {
    match map.get(key) {
        None => Ok(0),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| bad(key, "must be a non-negative integer")),
    }
}

impl PerfConfig {
    /// Reads this layer's keys ([`EXTRA_CONFIG_KEYS`]) from the extensions
    /// the storage crate handed back; every value is type- and bound-checked.
    pub fn from_extensions(map: &serde_json::Map<String, serde_json::Value>) -> Result<Self> {
        use kvcr_foundation::runner::{
            AnonymousMemory, HugePages, NumaBinding, NumaMode, PoolMemory, PutSplit,
        };
        let small = |key: &'static str| -> Result<usize> {
            usize::try_from(count(map, key)?).map_err(|_| bad(key, "too large"))
        };
        let huge_pages = match map.get("perf_huge_pages").map(|v| v.as_str()) {
            None => HugePages::Off,
            Some(Some("off")) => HugePages::Off,
            Some(Some("prefer")) => HugePages::Prefer,
            Some(Some("require")) => HugePages::Require,
            Some(_) => return Err(bad("perf_huge_pages", "must be off, prefer or require")),
        };
        let numa = match map.get("perf_numa_node") {
            None => None,
            Some(v) => {
                let node = v
                    .as_u64()
                    .and_then(|n| u16::try_from(n).ok())
                    .filter(|n| *n <= kvcr_foundation::runner::MAX_NUMA_NODE)
                    .ok_or_else(|| bad("perf_numa_node", "must be a node id in 0..=1023"))?;
                let mode = match map.get("perf_numa_mode").map(|v| v.as_str()) {
                    None | Some(Some("bind")) => NumaMode::Bind,
                    Some(Some("preferred")) => NumaMode::Preferred,
                    Some(Some("interleave")) => NumaMode::Interleave,
                    Some(_) => {
                        return Err(bad(
                            "perf_numa_mode",
                            "must be bind, preferred or interleave",
                        ));
                    }
                };
                Some(NumaBinding {
                    mode,
                    nodes: vec![node],
                })
            }
        };
        if numa.is_none() && map.contains_key("perf_numa_mode") {
            return Err(bad("perf_numa_mode", "needs perf_numa_node"));
        }
        let anonymous = match map.get("perf_anonymous_dram") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad("perf_anonymous_dram", "must be a boolean"))?,
        };
        let placed = huge_pages != HugePages::Off || numa.is_some();
        if placed && !anonymous {
            return Err(bad(
                "perf_anonymous_dram",
                "huge pages and NUMA binding need perf_anonymous_dram: true",
            ));
        }
        let pool_memory = if anonymous {
            PoolMemory::Anonymous(AnonymousMemory { huge_pages, numa })
        } else {
            PoolMemory::Default
        };
        let put_split = PutSplit {
            chunk_bytes: count(map, "perf_put_split_bytes")?,
            max_chunks_in_flight: small("perf_put_split_in_flight")?,
        };
        if put_split.chunk_bytes == 0 && put_split.max_chunks_in_flight != 0 {
            return Err(bad(
                "perf_put_split_in_flight",
                "needs perf_put_split_bytes",
            ));
        }
        Ok(Self {
            pool_memory,
            put_split,
            read_batch_pages: small("perf_read_batch_pages")?,
            read_batch_bytes: count(map, "perf_read_batch_bytes")?,
            exists_batch_pages: small("perf_exists_batch_pages")?,
        })
    }
}

/// [`KvcrHiCacheStorage`] with the performance controls.
#[derive(Debug)]
pub struct KvcrHiCachePerf {
    storage: KvcrHiCacheStorage,
    config: PerfConfig,
}

impl KvcrHiCachePerf {
    /// Builds the storage backend (same arguments, same order) with `perf`.
    pub fn new(storage: StorageConfig, groups: RankGroups, perf: PerfConfig) -> Result<Self> {
        let tuning = RunnerTuning {
            pool_memory: perf.pool_memory.clone(),
            put_split: perf.put_split,
        };
        let storage =
            KvcrHiCacheStorage::new(storage, groups).map_err(crate::error::PerfError::from)?;
        let storage = if tuning == RunnerTuning::default() {
            storage
        } else {
            storage.with_runner_tuning(tuning)
        };
        Ok(Self {
            storage,
            config: perf,
        })
    }

    /// Builds the backend from the engine's configuration alone: this
    /// layer's keys ([`EXTRA_CONFIG_KEYS`]) are read from the same extra
    /// config as the storage crate's; any other unknown key is refused.
    pub fn from_engine(storage: StorageConfig, groups: RankGroups) -> Result<Self> {
        let value = match &storage.extra_config {
            Some(serde_json::Value::String(text)) => {
                let text = text.trim();
                let body = match text.strip_prefix('@') {
                    Some(path) => std::fs::read_to_string(path)
                        .map_err(|_| bad("extra_config", "the @path file cannot be read"))?,
                    None if text.is_empty() => "{}".to_owned(),
                    None => text.to_owned(),
                };
                serde_json::from_str(&body)
                    .map_err(|_| bad("extra_config", "must be a JSON object (or its text)"))?
            }
            Some(other) => other.clone(),
            None => serde_json::Value::Object(serde_json::Map::new()),
        };
        let (backend, extensions) =
            kvcr_hicache_storage::BackendConfig::from_value_with_extensions(
                &value,
                EXTRA_CONFIG_KEYS,
            )?;
        let perf = PerfConfig::from_extensions(&extensions)?;
        let tuning = RunnerTuning {
            pool_memory: perf.pool_memory.clone(),
            put_split: perf.put_split,
        };
        let storage = KvcrHiCacheStorage::with_backend(storage, backend, groups)?;
        Ok(Self {
            storage: storage.with_runner_tuning(tuning),
            config: perf,
        })
    }

    /// The storage backend underneath (every other entry point).
    pub fn storage(&self) -> &KvcrHiCacheStorage {
        &self.storage
    }

    /// The controls in use.
    pub fn config(&self) -> &PerfConfig {
        &self.config
    }

    /// [`KvcrHiCacheStorage::register_host_pool`].
    ///
    /// # Safety
    /// As [`KvcrHiCacheStorage::register_host_pool`].
    #[allow(unsafe_code)]
    pub unsafe fn register_host_pool(&self, desc: HostPoolDesc) -> Result<()> {
        // SAFETY: the caller's promise is the storage crate's contract.
        unsafe { self.storage.register_host_pool(desc) }.map_err(Into::into)
    }

    /// [`KvcrHiCacheStorage::batch_exists`], in chunks of
    /// `exists_batch_pages` keys, stopping at the first chunk not all hits.
    pub fn batch_exists(&self, keys: &[BlockKey], extra: &ExtraInfo) -> usize {
        let n = self.config.exists_batch_pages;
        if n == 0 || keys.len() <= n {
            return self.storage.batch_exists(keys, extra);
        }
        let mut count = 0;
        for chunk in keys.chunks(n) {
            let hits = self.storage.batch_exists(chunk, extra);
            count += hits;
            if hits < chunk.len() {
                break;
            }
        }
        count
    }

    /// [`KvcrHiCacheStorage::batch_get`], in read batches.
    pub fn batch_get(&self, keys: &[BlockKey], host_pages: &[u64], extra: &ExtraInfo) -> Vec<bool> {
        let chunks = self.read_chunks(keys.len());
        if chunks.len() <= 1 || keys.len() != host_pages.len() {
            return self.storage.batch_get(keys, host_pages, extra);
        }
        let bytes = chunks
            .iter()
            .map(|r| r.len() as u64 * self.page_bytes())
            .collect();
        // Synchronous storage calls: the window holds one chunk at a time.
        let mut window = DeliveryWindow::new(
            bytes,
            WindowLimits {
                max_ops: 1,
                max_bytes: 0,
            },
        );
        let mut out = vec![false; keys.len()];
        let done = std::cell::RefCell::new(Vec::new());
        drive(
            &mut window,
            |chunk| {
                let range = chunks.get(chunk)?.clone();
                let (k, p) = (keys.get(range.clone())?, host_pages.get(range.clone())?);
                let got = self.storage.batch_get(k, p, extra);
                if let Some(slot) = out.get_mut(range) {
                    slot.copy_from_slice(got.get(..slot.len()).unwrap_or(&[]));
                }
                done.borrow_mut().push(chunk);
                Some(chunk)
            },
            || Some(done.borrow_mut().drain(..).map(|c| (c, true)).collect()),
        );
        out
    }

    /// [`KvcrHiCacheStorage::batch_set`] (unchanged).
    pub fn batch_set(&self, keys: &[BlockKey], host_pages: &[u64], extra: &ExtraInfo) -> Vec<bool> {
        self.storage.batch_set(keys, host_pages, extra)
    }

    fn page_bytes(&self) -> u64 {
        self.storage
            .span_plan()
            .map_or(0, |p| p.span_bytes * p.spans_per_page() as u64)
    }

    /// Key ranges of the read batches.
    fn read_chunks(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        let by_pages = self.config.read_batch_pages;
        let by_bytes = match (self.config.read_batch_bytes, self.page_bytes()) {
            (0, _) | (_, 0) => 0,
            (cap, page) => usize::try_from((cap / page).max(1)).unwrap_or(usize::MAX),
        };
        let size = match (by_pages, by_bytes) {
            (0, 0) => return std::iter::once(0..n).collect(),
            (0, b) => b,
            (p, 0) => p,
            (p, b) => p.min(b),
        };
        (0..n)
            .step_by(size)
            .map(|start| start..(start + size).min(n))
            .collect()
    }
}
