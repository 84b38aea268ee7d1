//! `kvcr_hicache._native`: kvcr's HiCache L3 storage backend
//! ([`kvcr_hicache_storage::KvcrHiCacheStorage`], one rank-local runner per
//! engine rank) as a Python extension.
//!
//! SGLang loads storage backends as subclasses of its Python ABC
//! `HiCacheStorage`, which a `#[pyclass]` cannot be; the pure-Python class
//! `kvcr_hicache.sglang.KvcrStorage` subclasses it and delegates every call
//! to the [`Backend`] defined here.
//!
//! Data never passes through Python objects: the engine's host pool is
//! registered once by address, and each `batch_get_v1` / `batch_set_v1` names
//! host pages by token index, so the runner copies between the engine's host
//! pages and KVCR DRAM directly. The legacy byte-copy calls (flat page tensors,
//! used by SGLang when `interface_v1` is off) go through a staging pool the
//! extension owns: one copy between the flat page and the staging page, done
//! here, then the same runner path.
//!
//! Every call that waits (a rank collective, a peer, a runner operation) or
//! copies releases the GIL for its duration. Data-path calls never raise:
//! like the backend itself, a bad argument (of the wrong type, a negative
//! index, a key that is not a digest, a host page named twice, a flat page
//! that is not a usable tensor) becomes a miss of the right shape and is
//! counted (`stats()["faults_argument"]`, or the backend's `faults_batch_*`);
//! the arguments are read by [`args`], not by PyO3's conversion, which would
//! raise. Only construction and registration raise `KvcrError`, so a
//! misconfigured engine fails at attach.

mod args;
mod error;
mod group;
mod raw_memory;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use kvcr_foundation::{BlockKey, RequestId};
use kvcr_hicache_storage::{
    ExtraInfo, HostLayout, HostPoolDesc, KvGeometry, KvcrHiCacheStorage, ROUTER_HINT_KEYS,
    RankGroups, SpanPlan, StorageConfig, pages_from_token_indices,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::Value;

use crate::error::{Error, KvcrError};
use crate::group::PyRankGroup;
use crate::raw_memory::{FlatPage, OwnedBuffer};

/// Staging pages per direction (legacy byte-copy calls): gets use pages
/// `0..STAGING_PAGES`, sets `STAGING_PAGES..2 * STAGING_PAGES`, so SGLang's
/// prefetch and backup threads never share one. Batches larger than this are
/// served in chunks.
pub const STAGING_PAGES: u64 = 8;

/// A host page index no pool has (see `Backend::paged`).
const NO_PAGE: u64 = u64::MAX;

/// The legacy staging pool: memory this extension owns, registered with the
/// backend as its host pool (page-first, the engine's page geometry).
struct Staging {
    buffer: OwnedBuffer,
    plan: SpanPlan,
    page_bytes: u64,
    /// Held while the get half of the pool is in use.
    gets: Mutex<()>,
    /// Held while the set half of the pool is in use.
    sets: Mutex<()>,
}

/// Counters of this layer (the backend counts its own; see `stats`).
#[derive(Default)]
struct Counters {
    /// Calls whose arguments were unusable (bad keys, indices, flat pages),
    /// served as misses.
    faults_argument: AtomicU64,
    /// `extra_info` payloads that were not JSON objects (served without a
    /// hint).
    extra_info_rejected: AtomicU64,
}

/// One engine rank's kvcr backend (the runner starts when a host pool is
/// registered).
///
/// Drop order is load-bearing: `storage` (its runner may still be copying
/// into a registered pool) is dropped before `staging` (the memory it may be
/// copying into), because fields drop in declaration order.
#[pyclass(frozen, name = "Backend", module = "kvcr_hicache._native")]
pub struct Backend {
    storage: KvcrHiCacheStorage,
    staging: OnceLock<Staging>,
    /// Tokens per page of the registered pool.
    page_size: OnceLock<u32>,
    counters: Counters,
}

fn lock(m: &Mutex<()>) -> std::sync::MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The leading run of keys that parse (SGLang keys are 64-hex page digests;
/// the backend keys pages by their first 16 hex digits, as SGLang's KV events
/// do).
fn leading_keys(keys: &[Option<BlockKey>]) -> Vec<BlockKey> {
    keys.iter().map_while(|k| *k).collect()
}

fn geometry(
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype_bytes: u32,
    page_size: u32,
) -> KvGeometry {
    KvGeometry {
        layers,
        kv_heads,
        head_dim,
        dtype_bytes,
        page_size,
    }
}

impl Backend {
    fn note_argument_fault(&self) {
        self.counters
            .faults_argument
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The request scope and router hint of an engine `extra_info` dict,
    /// passed as JSON text (only the keys the backend reads). Anything but
    /// `None` or a JSON object's text is counted and served without a hint.
    fn extra_info(&self, obj: Option<&Bound<'_, PyAny>>) -> ExtraInfo {
        let parsed = match args::extra_info_text(obj) {
            Ok(None) => return ExtraInfo::default(),
            Ok(Some(text)) => serde_json::from_str::<Value>(&text).ok(),
            Err(()) => None,
        };
        match parsed {
            Some(value) if value.is_object() => ExtraInfo::from_engine(&value),
            _ => {
                self.counters
                    .extra_info_rejected
                    .fetch_add(1, Ordering::Relaxed);
                ExtraInfo::default()
            }
        }
    }

    /// Keys of a data-path call; a non-sequence is counted and read as no
    /// keys (items that are not digests are `None`, counted by the caller).
    fn keys(&self, obj: &Bound<'_, PyAny>) -> Vec<Option<BlockKey>> {
        args::keys(obj).unwrap_or_else(|| {
            self.note_argument_fault();
            Vec::new()
        })
    }

    /// Host pages of SGLang-style token indices; `None` (counted) when there
    /// is no host pool yet, or the indices are not a list of non-negative
    /// integers making whole, aligned pages.
    fn host_pages(&self, token_indices: &Bound<'_, PyAny>) -> Option<Vec<u64>> {
        let pages = args::token_indices(token_indices).and_then(|indices| {
            self.page_size
                .get()
                .and_then(|&size| pages_from_token_indices(&indices, size).ok())
        });
        if pages.is_none() {
            self.note_argument_fault();
        }
        pages
    }

    /// Flat pages of a legacy call; a non-sequence reads as no pages (the
    /// length mismatch is counted by the caller).
    fn flat_pages(obj: &Bound<'_, PyAny>) -> Vec<Option<FlatPage>> {
        args::flat_pages(obj).unwrap_or_default()
    }

    /// Runs `op` (a storage call with rank collectives) over `keys` and
    /// `pages`, always with one entry per key: ranks must make the same
    /// collectives with the same shapes whatever their local input, so a
    /// malformed call (a key that is not a digest, unusable indices, lengths
    /// that differ) is not skipped but passed with pages that name no host
    /// page, which the backend refuses locally, before it touches memory, as
    /// a miss of every entry. Counted in `faults_argument`.
    fn paged(
        &self,
        parsed: &[Option<BlockKey>],
        pages: Option<Vec<u64>>,
        op: impl FnOnce(&[BlockKey], &[u64]) -> Vec<bool>,
    ) -> Vec<bool> {
        let keys_ok = parsed.iter().all(Option::is_some);
        let pages = match pages {
            Some(p) if keys_ok && p.len() == parsed.len() => p,
            Some(_) => {
                self.note_argument_fault();
                vec![NO_PAGE; parsed.len()]
            }
            // The caller already knows (and counted) why there are none.
            None => vec![NO_PAGE; parsed.len()],
        };
        let keys: Vec<BlockKey> = parsed
            .iter()
            .map(|k| k.unwrap_or(BlockKey::from_u64(0)))
            .collect();
        let mut out = op(&keys, &pages);
        out.resize(keys.len(), false);
        out
    }
}

#[pymethods]
impl Backend {
    /// Builds a backend from the engine's storage configuration, as JSON:
    /// the fields of SGLang's `HiCacheStorageConfig` (`tp_rank`, `tp_size`,
    /// `pp_size`, `attn_cp_*`, `dp_rank`, `is_mla_model`, `should_split_heads`,
    /// `model_name`) and `extra_config` (the backend's settings, validated
    /// strictly).
    ///
    /// `rank_group` is the engine's collective when more than one rank shares
    /// the KV (an object with `rank`, `size`, `all_reduce_min(list[int])` and
    /// `all_gather(list[int])`); `None` is one rank. SGLang's prefetch and
    /// backup threads each have their own group: pass the backup thread's as
    /// `backup_group` and the two never interleave rounds; without it,
    /// `rank_group` serves both and the engine must serialise the threads.
    #[new]
    #[pyo3(signature = (storage_config, rank_group=None, backup_group=None))]
    fn new(
        storage_config: &str,
        rank_group: Option<&Bound<'_, PyAny>>,
        backup_group: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let value: Value = serde_json::from_str(storage_config)
            .map_err(|e| Error::StorageConfig(format!("not JSON: {e}")))?;
        let config = StorageConfig::from_engine_json(&value).map_err(Error::from)?;
        let groups = match (rank_group, backup_group) {
            (None, None) => RankGroups::solo(),
            (Some(group), None) => RankGroups::shared(Arc::new(PyRankGroup::new(group)?)),
            (Some(prefetch), Some(backup)) => RankGroups {
                prefetch: Arc::new(PyRankGroup::new(prefetch)?),
                backup: Arc::new(PyRankGroup::new(backup)?),
            },
            (None, Some(_)) => {
                return Err(Error::StorageConfig(
                    "backup_group needs rank_group (the prefetch group) too".into(),
                )
                .into());
            }
        };
        let storage = KvcrHiCacheStorage::new(config, groups).map_err(Error::from)?;
        Ok(Self {
            storage,
            staging: OnceLock::new(),
            page_size: OnceLock::new(),
            counters: Counters::default(),
        })
    }

    /// Registers the engine's host KV pool by address and starts this rank's
    /// runner over it (KVCR DRAM is allocated and pre-faulted here, with the
    /// GIL released). Registering the same pool again is a no-op.
    ///
    /// Refused (`KvcrError`, before the runner starts) unless the description
    /// is plausible (a non-null base, a non-zero size that is exactly
    /// `pages` pages of the geometry, no wrap past the end of the address
    /// space) and every byte of `base .. base + nbytes` is mapped readable and
    /// writable in this process now (read from `/proc/self/maps`). Every call
    /// then checks each host page it names against this pool before copying.
    ///
    /// The caller promises what Rust cannot check: `base .. base + nbytes`
    /// is the pool's buffer (`kv_buffer.data_ptr()`, K half then V), it stays
    /// allocated (and mapped) for the life of this backend, and the engine
    /// does not touch a host page named in a call until that call returns.
    #[pyo3(signature = (*, layout, base, nbytes, pages, layers, kv_heads, head_dim, dtype_bytes, page_size))]
    #[allow(clippy::too_many_arguments)]
    fn register_host_pool(
        &self,
        py: Python<'_>,
        layout: &str,
        base: u64,
        nbytes: u64,
        pages: u64,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        page_size: u32,
    ) -> PyResult<()> {
        if self.staging.get().is_some() {
            return Err(Error::Argument(
                "this backend already serves legacy byte-copy calls through its staging pool"
                    .into(),
            )
            .into());
        }
        let desc = HostPoolDesc {
            layout: layout.parse::<HostLayout>().map_err(Error::from)?,
            base,
            len: nbytes,
            pages,
            geometry: geometry(layers, kv_heads, head_dim, dtype_bytes, page_size),
        };
        py.detach(|| {
            // SAFETY: the Python caller's promise, stated above and on
            // `KvcrStorage.register_mem_pool_host`: the buffer is the engine's
            // host pool, alive for this backend's life, and untouched by the
            // engine while a call names its pages.
            unsafe { self.storage.register_host_pool(desc) }
        })
        .map_err(Error::from)?;
        let _ = self.page_size.set(page_size);
        Ok(())
    }

    /// Prepares the legacy byte-copy path (SGLang without `interface_v1`):
    /// allocates a staging pool of `2 * STAGING_PAGES` pages of the engine's
    /// page geometry, owned by this backend, and registers it as the host
    /// pool. Idempotent for the same geometry.
    #[pyo3(signature = (*, layers, kv_heads, head_dim, dtype_bytes, page_size))]
    fn register_staging_pool(
        &self,
        py: Python<'_>,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        page_size: u32,
    ) -> PyResult<()> {
        let geometry = geometry(layers, kv_heads, head_dim, dtype_bytes, page_size);
        if let Some(staging) = self.staging.get() {
            if staging.page_bytes == geometry.page_bytes() {
                return Ok(());
            }
            return Err(
                Error::Argument("staging pool registered with another geometry".into()).into(),
            );
        }
        let pages = 2 * STAGING_PAGES;
        let len = HostPoolDesc::required_len(&geometry, pages)
            .ok_or_else(|| Error::Argument("page geometry overflows".into()))?;
        let buffer = OwnedBuffer::zeroed(len)?;
        let desc = HostPoolDesc {
            layout: HostLayout::PageFirst,
            base: buffer.addr(),
            len,
            pages,
            geometry,
        };
        let plan = SpanPlan::new(&desc).map_err(Error::from)?;
        py.detach(|| {
            // SAFETY: `buffer` is owned by this backend and, once stored in
            // `self.staging` below, dropped only after `self.storage` (field
            // order); it is touched only under the `gets`/`sets` locks.
            unsafe { self.storage.register_host_pool(desc) }
        })
        .map_err(Error::from)?;
        let staging = Staging {
            buffer,
            plan,
            page_bytes: geometry.page_bytes(),
            gets: Mutex::new(()),
            sets: Mutex::new(()),
        };
        // Registration above succeeded only once (a second one would have
        // been refused as a different pool), so this slot was empty.
        let _ = self.staging.set(staging);
        let _ = self.page_size.set(page_size);
        Ok(())
    }

    /// How many leading `keys` the rank group can serve (locally resident,
    /// or covered by the router hint in `extra_info`).
    #[pyo3(signature = (keys, extra_info=None))]
    fn batch_exists(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        extra_info: Option<&Bound<'_, PyAny>>,
    ) -> usize {
        // The hit count is one number whatever the batch: a key that is not
        // a digest just ends the run (ranks still make the same collective).
        let keys = self.keys(keys);
        let valid = leading_keys(&keys);
        if valid.len() < keys.len() {
            self.note_argument_fault();
        }
        let extra = self.extra_info(extra_info);
        py.detach(|| self.storage.batch_exists(&valid, &extra))
    }

    /// Restores `keys` into the registered host pool at `token_indices`
    /// (SGLang's `host_indices`, `page_size` per key): `True` per page every
    /// rank restored. Never raises: unusable arguments (indices that are not
    /// non-negative integers making whole pages, a host page outside the pool
    /// or named twice) are a `False` per key.
    #[pyo3(signature = (keys, token_indices, extra_info=None))]
    fn batch_get_v1(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        token_indices: &Bound<'_, PyAny>,
        extra_info: Option<&Bound<'_, PyAny>>,
    ) -> Vec<bool> {
        let extra = self.extra_info(extra_info);
        let keys = self.keys(keys);
        let pages = self.host_pages(token_indices);
        py.detach(|| self.paged(&keys, pages, |k, p| self.storage.batch_get(k, p, &extra)))
    }

    /// Stores the host pages at `token_indices` under `keys`: `True` per page
    /// every rank committed. Never raises (as `batch_get_v1`); a host page
    /// named twice stores nothing.
    #[pyo3(signature = (keys, token_indices, extra_info=None))]
    fn batch_set_v1(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        token_indices: &Bound<'_, PyAny>,
        extra_info: Option<&Bound<'_, PyAny>>,
    ) -> Vec<bool> {
        let extra = self.extra_info(extra_info);
        let keys = self.keys(keys);
        let pages = self.host_pages(token_indices);
        py.detach(|| self.paged(&keys, pages, |k, p| self.storage.batch_set(k, p, &extra)))
    }

    /// Legacy byte-copy read: restores `keys` into flat pages, one tensor per
    /// key: each must be a contiguous CPU `torch.Tensor` (exactly that type)
    /// of exactly one page's bytes, kept alive, unresized and untouched
    /// during the call. The memory written is read from the tensor itself
    /// and checked against its storage; a bare `(address, nbytes)` pair, or
    /// any other object, is a miss. `True` for the leading run of pages
    /// restored; the first miss and every page after it are `False`; tensors
    /// that share a byte make the whole call a miss.
    #[pyo3(signature = (keys, pages, extra_info=None))]
    fn batch_get_flat(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        extra_info: Option<&Bound<'_, PyAny>>,
    ) -> Vec<bool> {
        let extra = self.extra_info(extra_info);
        let keys = self.keys(keys);
        let pages = Self::flat_pages(pages);
        py.detach(|| self.flat_get(&keys, &pages, &extra))
    }

    /// Legacy byte-copy write: stores flat pages (tensors, as for
    /// `batch_get_flat`) under `keys`. `True` per page committed.
    #[pyo3(signature = (keys, pages, extra_info=None))]
    fn batch_set_flat(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        extra_info: Option<&Bound<'_, PyAny>>,
    ) -> Vec<bool> {
        let extra = self.extra_info(extra_info);
        let keys = self.keys(keys);
        let pages = Self::flat_pages(pages);
        py.detach(|| self.flat_set(&keys, &pages, &extra))
    }

    /// Bytes of one page (K and V of every layer), once a pool is registered.
    #[getter]
    fn page_bytes(&self) -> Option<u64> {
        self.storage
            .span_plan()
            .map(|plan| plan.span_bytes * plan.spans_per_page() as u64)
    }

    /// Where this rank's runner listens for peers (peer mode, once a pool is
    /// registered): the `source_control_endpoint` a router names in hints.
    #[getter]
    fn endpoint(&self) -> Option<String> {
        self.storage.endpoint().map(|e| e.to_string())
    }

    /// Where this rank publishes its DP group's KV events (the ZMQ PUB a
    /// router subscribes to: `publish_inventory`, on the DP owner rank, once
    /// a pool is registered); `None` elsewhere.
    #[getter]
    fn kv_events_endpoint(&self) -> Option<String> {
        self.storage
            .kv_event_endpoints()
            .map(|e| e.publish.to_string())
    }

    /// The replay endpoint of [`Self::kv_events_endpoint`]'s stream.
    #[getter]
    fn kv_events_replay_endpoint(&self) -> Option<String> {
        self.storage
            .kv_event_endpoints()
            .map(|e| e.replay.to_string())
    }

    /// Spans (contiguous host ranges) per page of the registered pool.
    #[getter]
    fn spans_per_page(&self) -> Option<usize> {
        self.storage.span_plan().map(|plan| plan.spans_per_page())
    }

    /// The registration the engine forwards to its router, as `(key, value)`
    /// pairs in publish order (`router_hint` last); empty on ranks that do
    /// not own their DP group. Raises `KvcrError` when the control endpoint
    /// map cannot be built whole.
    fn registration_metadata(&self) -> PyResult<Vec<(String, String)>> {
        Ok(self.storage.registration_metadata().map_err(Error::from)?)
    }

    /// Detaches from the routers: publishes what is queued, then
    /// `AllBlocksCleared`, and stops the publisher. Returns whether this rank
    /// had one running.
    fn close_inventory(&self, py: Python<'_>) -> bool {
        py.detach(|| self.storage.close_inventory().is_some())
    }

    /// Ends a request's hint scope (the engine calls it when the request
    /// finishes).
    fn discard_request(&self, request_id: &str) {
        self.storage
            .discard_request(&RequestId(request_id.to_owned()));
    }

    /// Gathers every rank's evictions and publishes `Removed` for published
    /// pages among them (a collective: call it on every rank).
    fn sync_inventory(&self, py: Python<'_>) {
        py.detach(|| self.storage.sync_inventory());
    }

    /// Published pages evicted since the last call, as unsigned 64-bit page
    /// hashes (for engines that publish inventory themselves).
    fn take_removed_page_hashes(&self) -> Vec<u64> {
        self.storage
            .take_removed_page_hashes()
            .into_iter()
            .map(BlockKey::as_u64)
            .collect()
    }

    /// Pages published as stored and not removed.
    fn published_pages(&self) -> usize {
        self.storage.published_pages()
    }

    /// Counters: the backend's (`faults_*`, `hinted_pages_*`,
    /// `pages_restored`, ...), this layer's (`faults_argument`,
    /// `extra_info_rejected`) and `last_error`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.storage.stats();
        let d = PyDict::new(py);
        for (name, value) in [
            ("faults_batch_exists", s.faults_batch_exists),
            ("faults_batch_get", s.faults_batch_get),
            ("faults_batch_set", s.faults_batch_set),
            ("faults_collective", s.faults_collective),
            ("hints_rejected", s.hints_rejected),
            ("hints_ignored", s.hints_ignored),
            ("hinted_pages_requested", s.hinted_pages_requested),
            ("hinted_pages_loaded", s.hinted_pages_loaded),
            ("pages_restored", s.pages_restored),
            ("pages_committed", s.pages_committed),
            ("pages_published", s.pages_published),
            ("pages_removed", s.pages_removed),
            ("pages_unpublished", s.pages_unpublished),
            ("ops_abandoned", s.ops_abandoned),
            (
                "faults_argument",
                self.counters.faults_argument.load(Ordering::Relaxed),
            ),
            (
                "extra_info_rejected",
                self.counters.extra_info_rejected.load(Ordering::Relaxed),
            ),
        ] {
            d.set_item(name, value)?;
        }
        if let Some(peer) = self.storage.peer_counters() {
            for (name, value) in [
                ("peer_keys_received", peer.keys_received),
                ("peer_keys_sent", peer.keys_sent),
                ("peer_bytes_sent", peer.bytes_sent),
            ] {
                d.set_item(name, value)?;
            }
        }
        if let Some(p) = self.storage.publisher_stats() {
            for (name, value) in [
                ("inventory_stored_blocks", p.core.stored_blocks),
                ("inventory_removed_blocks", p.core.removed_blocks),
                ("inventory_batches", p.core.batches),
                ("inventory_heartbeats", p.core.heartbeats),
                ("inventory_replay_requests", p.replay_requests),
                ("inventory_queue_dropped", p.queue_dropped),
            ] {
                d.set_item(name, value)?;
            }
        }
        d.set_item("last_error", s.last_error)?;
        Ok(d)
    }
}

impl Backend {
    /// Legacy get: chunks of `STAGING_PAGES` keys through the get half of
    /// the staging pool. The result is the leading run of pages restored and
    /// copied out (SGLang reads no further). Every chunk makes its storage
    /// call, with its collectives, on every rank whatever happened locally,
    /// so ranks stay in step; after this rank's first miss nothing more is
    /// copied out.
    fn flat_get(
        &self,
        keys: &[Option<BlockKey>],
        pages: &[Option<FlatPage>],
        extra: &ExtraInfo,
    ) -> Vec<bool> {
        let staging = self.staging.get();
        let _held = staging.map(|s| lock(&s.gets));
        let mut out = vec![false; keys.len()];
        // Tensors that share a byte: two copies into one destination.
        let usable = staging.is_some() && pages.len() == keys.len() && !args::overlapping(pages);
        if !usable {
            self.note_argument_fault();
        }
        let mut missed = !usable;
        let chunk = STAGING_PAGES as usize;
        for (index, key_chunk) in keys.chunks(chunk).enumerate() {
            let start = index * chunk;
            let slots = usable.then(|| (0..key_chunk.len() as u64).collect());
            let restored = self.paged(key_chunk, slots, |k, p| self.storage.batch_get(k, p, extra));
            for (i, ok) in restored.into_iter().enumerate() {
                missed = missed
                    || !ok
                    || !staging.is_some_and(|staging| {
                        self.copy_out(staging, i as u64, pages.get(start + i).copied().flatten())
                    });
                if missed {
                    break;
                }
                if let Some(slot) = out.get_mut(start + i) {
                    *slot = true;
                }
            }
        }
        out
    }

    /// Legacy set: chunks of `STAGING_PAGES` flat pages through the set half
    /// of the staging pool; `True` per page committed. Every chunk makes its
    /// storage call on every rank; a chunk with a page that cannot be staged
    /// (wrong size, bad address) passes no host pages and stores nothing.
    fn flat_set(
        &self,
        keys: &[Option<BlockKey>],
        pages: &[Option<FlatPage>],
        extra: &ExtraInfo,
    ) -> Vec<bool> {
        let staging = self.staging.get();
        let _held = staging.map(|s| lock(&s.sets));
        let mut out = vec![false; keys.len()];
        // Tensors that share a byte are refused as `batch_set_v1` refuses a
        // host page named twice.
        let usable = staging.is_some() && pages.len() == keys.len() && !args::overlapping(pages);
        if !usable {
            self.note_argument_fault();
        }
        let chunk = STAGING_PAGES as usize;
        for (index, key_chunk) in keys.chunks(chunk).enumerate() {
            let start = index * chunk;
            let staged = usable
                && staging.is_some_and(|staging| {
                    (0..key_chunk.len()).all(|i| {
                        let slot = STAGING_PAGES + i as u64;
                        self.copy_in(staging, slot, pages.get(start + i).copied().flatten())
                    })
                });
            let slots =
                staged.then(|| (STAGING_PAGES..STAGING_PAGES + key_chunk.len() as u64).collect());
            let stored = self.paged(key_chunk, slots, |k, p| self.storage.batch_set(k, p, extra));
            for (i, ok) in stored.into_iter().enumerate() {
                if let Some(slot) = out.get_mut(start + i) {
                    *slot = ok;
                }
            }
        }
        out
    }

    /// Copies staging slot `slot` out into `page`; `false` (counted) for a
    /// page that is not a usable tensor (`None`) or not one page's size.
    fn copy_out(&self, staging: &Staging, slot: u64, page: Option<FlatPage>) -> bool {
        let spans = staging.plan.page_spans(slot);
        let Some(page) = page.filter(|p| p.len == staging.page_bytes) else {
            self.note_argument_fault();
            return false;
        };
        // SAFETY: `page` is exactly the memory of a contiguous CPU tensor,
        // read from the tensor and checked against its storage
        // (`args::flat_pages`), which the caller keeps alive, unresized and
        // untouched for the call (the contract of `batch_get_flat`); no two
        // pages of the call overlap (checked); the staging slot belongs to
        // the get half, whose lock this thread holds.
        let copied = unsafe { raw_memory::gather_into(&staging.buffer, &spans, page) };
        if copied.is_err() {
            self.note_argument_fault();
        }
        copied.is_ok()
    }

    /// Copies `page` into staging slot `slot`; `false` (counted) as for
    /// [`Self::copy_out`].
    fn copy_in(&self, staging: &Staging, slot: u64, page: Option<FlatPage>) -> bool {
        let spans = staging.plan.page_spans(slot);
        let Some(page) = page.filter(|p| p.len == staging.page_bytes) else {
            self.note_argument_fault();
            return false;
        };
        // SAFETY: as in `copy_out` (here the tensor is only read), for the
        // set half of the staging pool.
        let copied = unsafe { raw_memory::scatter_from(&staging.buffer, &spans, page) };
        if copied.is_err() {
            self.note_argument_fault();
        }
        copied.is_ok()
    }
}

/// The benchmark's anchor: the same restore as `Backend.batch_get_v1`, driven
/// from Rust `iterations` times (no Python between iterations). Returns the
/// seconds each iteration took, and whether every page was restored each time.
#[pyfunction]
fn restore_from_rust(
    py: Python<'_>,
    backend: &Backend,
    keys: &Bound<'_, PyAny>,
    token_indices: &Bound<'_, PyAny>,
    iterations: u32,
) -> (Vec<f64>, bool) {
    let Some(pages) = backend.host_pages(token_indices) else {
        return (Vec::new(), false);
    };
    let keys = backend.keys(keys);
    let valid = leading_keys(&keys);
    let extra = ExtraInfo::default();
    py.detach(|| {
        let mut seconds = Vec::with_capacity(iterations as usize);
        let mut all = valid.len() == keys.len();
        for _ in 0..iterations {
            // A benchmark driver, not a sans-I/O core: it reads the clock.
            #[allow(clippy::disallowed_methods)]
            let start = std::time::Instant::now();
            let restored = backend.storage.batch_get(&valid, &pages, &extra);
            seconds.push(start.elapsed().as_secs_f64());
            all &= restored.iter().all(|&ok| ok);
        }
        (seconds, all)
    })
}

/// The extension module `kvcr_hicache._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Backend>()?;
    m.add_function(wrap_pyfunction!(restore_from_rust, m)?)?;
    m.add("KvcrError", m.py().get_type::<KvcrError>())?;
    m.add("ROUTER_HINT_KEYS", ROUTER_HINT_KEYS.to_vec())?;
    m.add("STAGING_PAGES", STAGING_PAGES)?;
    Ok(())
}
