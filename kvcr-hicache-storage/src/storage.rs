//! [`KvcrHiCacheStorage`]: the HiCache L3 backend of one rank.
//!
//! Each entry point runs in three phases:
//!
//! 1. **local** (fallible, panics caught): validate, query or move bytes
//!    through this rank's runner; any error becomes a local miss of the right
//!    shape and is counted in `faults_<method>`;
//! 2. **agree** (always runs, on every rank, whatever phase 1 did): MIN-reduce
//!    the local answer over the rank group; a failed collective is a miss
//!    everywhere (`faults_collective`);
//! 3. **publish** (`batch_set` only): feed rank-agreed facts to the ledger and
//!    send its events to the sink.
//!
//! Nothing is ever latched: a fault affects the call it happened in, and the
//! next call starts clean. No call returns while a copy it started may still
//! write into the engine's host pages (the runner's operation deadline fires
//! before the call's wait budget; a call that outlives even that aborts and
//! waits once more).

use std::collections::{HashMap, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use kvcr_foundation::hint::WorkerType;
use kvcr_foundation::protocol::{ElementRef, OpHandle, RegionId};
use kvcr_foundation::publisher::{
    BindScope, OwnershipWire, PubSocket, Publisher, PublisherConfig, PublisherStats, TopicParts,
};
use kvcr_foundation::runner::{
    CachePolicy, DeliverEntry, DepositEntry, KeylessSources, OpResult, PeerCounters, PeerOptions,
    PoolConfig, QueryStatus, Runner, RunnerConfig, RunnerStats, policy,
};
use kvcr_foundation::{
    BlockKey, CompatDigest, ControlEndpoint, FetchHint, Incarnation, InventoryEvent,
    InventoryScope, InventorySink, Namespace, NamespaceId, Owner, RankCoordinate, RequestId,
    ScopedKey, WorkerEndpointMap,
};
use serde_json::Value;

use crate::config::{BackendConfig, EvictionPolicy, StorageConfig, redact_extra};
use crate::error::{Error, Result};
use crate::faults::{FaultInjector, Method};
use crate::group::{RankGroup, RankGroups};
use crate::layout::{HostPoolDesc, POOL_NAME, SpanPlan};
use crate::ledger::{EvictionCollector, Ledger, PageTokens};
use crate::mapping;

/// Extra-info keys engines have carried the router hint under.
pub const ROUTER_HINT_KEYS: [&str; 2] = ["kvcr_router_hint", "kvcc_router_hint"];

/// Most evicted keys exchanged per round (the rest wait for the next one).
const MAX_EVICTIONS_PER_ROUND: usize = 1 << 16;

/// Per-request information that travels with a storage call (SGLang's
/// `HiCacheStorageExtraInfo`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExtraInfo {
    /// The request (hint scope). Without one, a hint lives for one call.
    pub request_id: Option<RequestId>,
    /// The router hint: a `kv.fetch@1.0` envelope or the legacy compact
    /// form, as a JSON value or JSON text.
    pub router_hint: Option<Value>,
    /// For `batch_set`: the pages' tokens, so their `Stored` events carry
    /// real token ids (without them pages are stored but not published).
    pub pages: Option<PageTokens>,
}

impl ExtraInfo {
    /// A request with a router hint.
    pub fn hinted(request: &str, hint: Value) -> Self {
        Self {
            request_id: Some(RequestId(request.to_owned())),
            router_hint: Some(hint),
            pages: None,
        }
    }

    /// From an engine's `extra_info` dict: the hint under one of
    /// [`ROUTER_HINT_KEYS`], the request under `request_id` / `rid`, and,
    /// for `batch_set`, what publishing its pages needs: `token_ids` (the
    /// pages' real tokens), the chain's parent as the last of `prefix_keys`
    /// (SGLang's 64-hex page keys), and the namespace as a router indexes it
    /// (`cache_salt`, `lora_name`, `lora_id`). Tokens that are not a list of
    /// 32-bit unsigned integers, or a tag of the wrong type, leave the pages
    /// unpublished (counted as `pages_unpublished`), never mis-published.
    pub fn from_engine(extra_info: &Value) -> Self {
        let request_id = ["request_id", "rid"]
            .iter()
            .find_map(|k| extra_info.get(*k).and_then(Value::as_str))
            .map(|s| RequestId(s.to_owned()));
        let router_hint = ROUTER_HINT_KEYS
            .iter()
            .find_map(|k| extra_info.get(*k))
            .filter(|v| !v.is_null())
            .cloned();
        Self {
            request_id,
            router_hint,
            pages: page_tokens(extra_info),
        }
    }
}

/// The publishing part of an engine's `extra_info` (see
/// [`ExtraInfo::from_engine`]); `None` without usable tokens.
fn page_tokens(extra_info: &Value) -> Option<PageTokens> {
    let token_ids = extra_info
        .get("token_ids")?
        .as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()?;
    let parent = match extra_info.get("prefix_keys") {
        None | Some(Value::Null) => None,
        Some(keys) => match keys.as_array()?.last() {
            None => None,
            Some(key) => Some(BlockKey::from_hex_digest(key.as_str()?).ok()?),
        },
    };
    let text = |key: &str| -> Option<Option<String>> {
        match extra_info.get(key) {
            None | Some(Value::Null) => Some(None),
            Some(v) => v.as_str().map(|s| Some(s.to_owned())),
        }
    };
    let lora_id = match extra_info.get("lora_id") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64()?),
    };
    Some(PageTokens {
        parent,
        token_ids,
        lora_name: text("lora_name")?,
        lora_id,
        cache_salt: text("cache_salt")?,
    })
}

/// Where a publishing rank's KV events can be subscribed to (advertised with
/// the control channel's advertise host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventEndpoints {
    /// The PUB socket (`endpoint` in a Dynamo indexer registration).
    pub publish: ControlEndpoint,
    /// The replay ROUTER (`replay_endpoint`).
    pub replay: ControlEndpoint,
}

/// Counters of one rank's backend.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StorageStats {
    /// Internal faults turned into misses, per entry point.
    pub faults_batch_exists: u64,
    /// See `faults_batch_exists`.
    pub faults_batch_get: u64,
    /// See `faults_batch_exists`.
    pub faults_batch_set: u64,
    /// Failed rank collectives (each made the whole call a miss).
    pub faults_collective: u64,
    /// Router hints that did not parse (or could not be dialled).
    pub hints_rejected: u64,
    /// Hints received while remote hints are off.
    pub hints_ignored: u64,
    /// Pages `batch_get` asked a hinted peer for.
    pub hinted_pages_requested: u64,
    /// Of those, pages restored (the honest hint metric).
    pub hinted_pages_loaded: u64,
    /// Pages `batch_get` restored on every rank.
    pub pages_restored: u64,
    /// Pages `batch_set` committed on every rank.
    pub pages_committed: u64,
    /// `Stored` pages published.
    pub pages_published: u64,
    /// `Removed` pages published.
    pub pages_removed: u64,
    /// Agreed pages not published for lack of tokens.
    pub pages_unpublished: u64,
    /// Operations that did not complete even after an abort (their memory is
    /// the runner's to keep safe; counted because it should never happen).
    pub ops_abandoned: u64,
    /// The last internal error, for logs.
    pub last_error: Option<String>,
}

#[derive(Debug, Default)]
struct Counters {
    faults_batch_exists: AtomicU64,
    faults_batch_get: AtomicU64,
    faults_batch_set: AtomicU64,
    faults_collective: AtomicU64,
    hints_rejected: AtomicU64,
    hints_ignored: AtomicU64,
    hinted_pages_requested: AtomicU64,
    hinted_pages_loaded: AtomicU64,
    pages_restored: AtomicU64,
    pages_committed: AtomicU64,
    pages_published: AtomicU64,
    pages_removed: AtomicU64,
    pages_unpublished: AtomicU64,
    ops_abandoned: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic under one of these locks is caught at the entry point; the data
    // behind them stays structurally valid, so keep serving.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The live hint scopes of this rank, oldest first.
#[derive(Debug, Default)]
struct HintScopes {
    live: VecDeque<RequestId>,
    next_anonymous: u64,
}

/// What exists once the host pool is registered.
struct Active {
    desc: HostPoolDesc,
    plan: SpanPlan,
    /// Shared by the prefetch and backup threads: the runner's API takes
    /// `&self`, and each thread waits for its own operations.
    runner: Runner,
    regions: Vec<RegionId>,
    /// One namespace per segment of a page.
    segments: Vec<NamespaceId>,
    endpoint: Option<ControlEndpoint>,
}

impl Active {
    /// Waits for `op`'s result (other threads' results stay theirs).
    fn wait_op(&self, op: OpHandle, budget: Duration) -> Option<OpResult> {
        // An unknown handle cannot happen for an operation this backend
        // issued and has not taken; treat it as "no result".
        self.runner.wait(op, budget).ok().flatten()
    }

    /// Waits for `op`; past `budget`, aborts it and waits up to `grace` more
    /// (copies are bounded, so this ends); an operation that still has not
    /// completed is abandoned (its late result is dropped) and `None` returned.
    fn finish_op(
        &self,
        op: OpHandle,
        budget: Duration,
        grace: Duration,
        abandoned: &AtomicU64,
    ) -> Option<OpResult> {
        if let Some(r) = self.wait_op(op, budget) {
            return Some(r);
        }
        self.runner.abort(op, None);
        if let Some(r) = self.wait_op(op, grace) {
            return Some(r);
        }
        bump(abandoned, 1);
        self.runner.discard_result(op);
        None
    }

    fn scoped(&self, key: BlockKey) -> impl Iterator<Item = ScopedKey> + '_ {
        self.segments.iter().map(move |ns| ScopedKey {
            namespace: *ns,
            key,
        })
    }

    /// The element references of segment `s` of host page `page`.
    fn elements(&self, segment: usize, page: u64) -> Vec<ElementRef> {
        let range = self.plan.segments.get(segment).cloned().unwrap_or(0..0);
        self.regions
            .get(range)
            .unwrap_or_default()
            .iter()
            .map(|region| ElementRef {
                region: *region,
                index: page,
            })
            .collect()
    }
}

/// Runner options a performance layer (`kvcr-hicache-perf`) may set before
/// the host pool is registered; the default is this crate's own behaviour.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunnerTuning {
    /// How the runner backs its pool (anonymous memory, huge pages, NUMA).
    pub pool_memory: kvcr_foundation::runner::PoolMemory,
    /// UCX split sizing of the runner's puts (peer mode).
    pub put_split: kvcr_foundation::runner::PutSplit,
}

/// The HiCache L3 storage backend of one rank, over its own rank-local runner.
///
/// Entry points take `&self` and may be called from several threads (the
/// engine's prefetch and backup threads); collectives use the group of the
/// calling role ([`RankGroups`]).
pub struct KvcrHiCacheStorage {
    storage: StorageConfig,
    backend: BackendConfig,
    coordinate: RankCoordinate,
    groups: RankGroups,
    active: OnceLock<Active>,
    register: Mutex<()>,
    ledger: Mutex<Ledger>,
    evictions: EvictionCollector,
    sink: Mutex<Option<Box<dyn InventorySink>>>,
    hints: Mutex<HintScopes>,
    counters: Counters,
    last_error: Mutex<Option<String>>,
    faults: FaultInjector,
    page_namespace: NamespaceId,
    tuning: RunnerTuning,
    /// The KV-event publisher (`publish_inventory`, DP owner rank only).
    /// Dropped with the backend, which publishes the closing
    /// `AllBlocksCleared`; [`KvcrHiCacheStorage::close_inventory`] does it
    /// earlier.
    publisher: Mutex<Option<Publisher>>,
    /// What the publisher advertises, kept after it closed.
    kv_events: OnceLock<KvEventEndpoints>,
}

impl std::fmt::Debug for KvcrHiCacheStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvcrHiCacheStorage")
            .field("model", &self.storage.model_name)
            .field("tp_rank", &self.storage.tp_rank)
            .field("registered", &self.active.get().is_some())
            .finish_non_exhaustive()
    }
}

/// 64-bit FNV-1a over length-prefixed fields (stable across builds).
fn digest(fields: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for field in fields {
        for b in (field.len() as u64)
            .to_be_bytes()
            .iter()
            .chain(field.iter())
        {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl KvcrHiCacheStorage {
    /// Validates the engine's configuration and this backend's extra config.
    /// The runner starts when the host pool is registered.
    pub fn new(storage: StorageConfig, groups: RankGroups) -> Result<Self> {
        let backend = match &storage.extra_config {
            Some(Value::String(text)) => BackendConfig::parse(text)?,
            Some(other) => BackendConfig::from_value(other)?,
            None => BackendConfig::from_value(&Value::Object(serde_json::Map::new()))?,
        };
        Self::with_backend(storage, backend, groups)
    }

    /// Like [`Self::new`] with an already parsed backend configuration (a
    /// layer above that parsed its own keys from the same extra config with
    /// [`BackendConfig::from_value_with_extensions`]).
    pub fn with_backend(
        mut storage: StorageConfig,
        backend: BackendConfig,
        groups: RankGroups,
    ) -> Result<Self> {
        // The secret lives in `backend` only; the raw extra config kept here
        // has it redacted.
        storage.extra_config = storage.extra_config.as_ref().map(redact_extra);
        let coordinate = storage.validate()?;
        if backend.enable_remote_hint {
            // This rank binds base + its global offset: refuse an overflow now.
            backend.bind_address(coordinate.global_offset())?;
        }
        if backend.publish_inventory {
            backend.kv_events_bind(coordinate.dp())?;
        }
        if groups.prefetch.size() != groups.backup.size()
            || groups.prefetch.rank() != groups.backup.rank()
        {
            return Err(Error::config(
                "rank_groups",
                "prefetch and backup groups must have the same rank and size",
            ));
        }
        let group_size = storage.tp_size.saturating_mul(storage.attn_cp_size);
        if groups.prefetch.size() != group_size {
            return Err(Error::config(
                "rank_groups",
                format!(
                    "group has {} ranks; tp_size * attn_cp_size is {group_size}",
                    groups.prefetch.size()
                ),
            ));
        }
        // The published namespace: the model's pages, whatever the rank.
        let page_namespace = Namespace::base(CompatDigest(digest(&[
            b"kvcr-hicache-page-v1",
            storage.model_name.as_bytes(),
        ])))
        .id();
        let scope = InventoryScope {
            owner: Owner::Kvcr,
            namespace: page_namespace,
            medium: backend.medium,
        };
        Ok(Self {
            coordinate,
            groups,
            active: OnceLock::new(),
            register: Mutex::new(()),
            ledger: Mutex::new(Ledger::new(scope, 0)),
            evictions: EvictionCollector::default(),
            sink: Mutex::new(None),
            hints: Mutex::new(HintScopes::default()),
            counters: Counters::default(),
            last_error: Mutex::new(None),
            faults: FaultInjector::default(),
            page_namespace,
            storage,
            backend,
            tuning: RunnerTuning::default(),
            publisher: Mutex::new(None),
            kv_events: OnceLock::new(),
        })
    }

    /// Whether this rank publishes its DP group's inventory: the group's
    /// first rank (TP and CP rank 0). Every rank's ledger is the same, so one
    /// stream per DP group says it once.
    fn is_dp_owner(&self) -> bool {
        self.coordinate.within_dp_offset() == 0
    }

    /// Starts the KV-event publisher (`publish_inventory`, DP owner only).
    fn start_publisher(&self) -> Result<()> {
        let b = &self.backend;
        if !b.publish_inventory || !self.is_dp_owner() {
            return Ok(());
        }
        let (pub_bind, replay_bind) = b.kv_events_bind(self.coordinate.dp())?;
        let parts = TopicParts {
            worker_id: b.kv_events_worker_id,
            dp_rank: self.coordinate.dp(),
        };
        let mut config =
            PublisherConfig::new(parts, Incarnation::generate(), PubSocket::Bind(pub_bind))
                .with_replay(replay_bind);
        // The stream is kvcr's own (only KVCR DRAM pages go on it), so
        // ownership is the stream's: what Dynamo's worker-domain indexer reads.
        config.ownership = OwnershipWire::Stream;
        // The sockets bind on `control_host`, beside the control channel:
        // routers on other hosts dial them at the advertise host that
        // `publish_inventory` requires, so binding beyond loopback is the
        // operator's explicit choice here.
        config.bind_scope = BindScope::AnyAddress;
        config.heartbeat = Some(b.inventory_heartbeat);
        let publisher = Publisher::start(config).map_err(|e| Error::Publisher(e.to_string()))?;
        let host = b.advertise_host()?;
        let advertise = |bound: Option<&kvcr_foundation::BindAddress>, what: &str| {
            bound
                .ok_or_else(|| Error::Publisher(format!("the {what} socket reports no bound port")))
                .and_then(|a| {
                    ControlEndpoint::new(host.clone(), a.port)
                        .map_err(|e| Error::Publisher(e.to_string()))
                })
        };
        let bound = publisher.bound();
        let endpoints = KvEventEndpoints {
            publish: advertise(bound.pub_bound.as_ref(), "PUB")?,
            replay: advertise(bound.replay_bound.as_ref(), "replay")?,
        };
        *lock(&self.sink) = Some(Box::new(publisher.sink()));
        let _ = self.kv_events.set(endpoints);
        *lock(&self.publisher) = Some(publisher);
        Ok(())
    }

    /// Where this rank's KV events are published (`publish_inventory`, on the
    /// DP owner rank, once the host pool is registered); `None` elsewhere.
    pub fn kv_event_endpoints(&self) -> Option<KvEventEndpoints> {
        self.kv_events.get().cloned()
    }

    /// The publisher's counters, while it runs.
    pub fn publisher_stats(&self) -> Option<PublisherStats> {
        lock(&self.publisher).as_ref().map(Publisher::stats)
    }

    /// Detach from the routers: publishes what is queued, then
    /// `AllBlocksCleared`, and stops the publisher (dropping the backend
    /// does the same). Pages stay in KVCR DRAM and are still served to
    /// peers that were hinted; nothing new is published. Returns the
    /// publisher's final counters (`None` when this rank does not publish).
    pub fn close_inventory(&self) -> Option<PublisherStats> {
        let running = lock(&self.publisher).take()?;
        *lock(&self.sink) = None;
        running.close().ok()
    }

    /// The registration an engine forwards to its router, in publish order
    /// (`router_hint` last, so a partial registration is never taken as a
    /// capability): on a publishing DP owner `kv_events_endpoint` and
    /// `kv_events_replay_endpoint`; with remote hints on, then
    /// `router_hint_source_control_endpoints` (JSON: every DP rank's
    /// control endpoint, all or nothing), `router_hint_worker_type` and
    /// `router_hint` (`true`). Empty on other ranks, and before the host pool
    /// is registered. An endpoint map that cannot be built whole is an error.
    pub fn registration_metadata(&self) -> Result<Vec<(String, String)>> {
        let b = &self.backend;
        if !self.is_dp_owner() || self.active.get().is_none() {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        if let Some(events) = self.kv_events.get() {
            out.push(("kv_events_endpoint".to_owned(), events.publish.to_string()));
            out.push((
                "kv_events_replay_endpoint".to_owned(),
                events.replay.to_string(),
            ));
        }
        if b.enable_remote_hint {
            let stride = u64::from(self.storage.tp_size) * u64::from(self.storage.attn_cp_size);
            let map = WorkerEndpointMap::for_dp_range(
                &b.advertise_host()?,
                b.control_port,
                0,
                self.storage.dp_size,
                stride,
            )
            .and_then(|m| m.check_advertisable(b.advertise_policy()).map(|()| m))
            .map_err(|e| Error::Publisher(format!("router_hint_source_control_endpoints: {e}")))?;
            // Our own rank's entry names our member key, so a destination
            // talks only to us there (other ranks' keys are not known here).
            let own_key = self
                .active
                .get()
                .and_then(|a| a.endpoint.as_ref()?.key().copied());
            let map = match own_key {
                Some(key) => map.with_member_key(self.coordinate.dp(), key),
                None => map,
            };
            out.push((
                "router_hint_source_control_endpoints".to_owned(),
                map.to_json(),
            ));
            let role = match b.worker_type {
                WorkerType::Aggregated => "aggregated",
                WorkerType::Prefill => "prefill",
                WorkerType::Decode => "decode",
            };
            out.push(("router_hint_worker_type".to_owned(), role.to_owned()));
            out.push(("router_hint".to_owned(), "true".to_owned()));
        }
        Ok(out)
    }

    /// Sets runner options for the runner started at registration (a no-op
    /// on the runner once the host pool is registered).
    pub fn with_runner_tuning(mut self, tuning: RunnerTuning) -> Self {
        self.tuning = tuning;
        self
    }

    /// The runner options in use.
    pub fn runner_tuning(&self) -> &RunnerTuning {
        &self.tuning
    }

    /// The validated backend configuration.
    pub fn backend_config(&self) -> &BackendConfig {
        &self.backend
    }

    /// The namespace id published pages carry.
    pub fn page_namespace(&self) -> NamespaceId {
        self.page_namespace
    }

    /// Where this rank's runner listens for peers (peer mode, once registered).
    pub fn endpoint(&self) -> Option<ControlEndpoint> {
        self.active.get().and_then(|a| a.endpoint.clone())
    }

    /// The span plan of the registered host pool.
    pub fn span_plan(&self) -> Option<&SpanPlan> {
        self.active.get().map(|a| &a.plan)
    }

    /// Fault injection for this rank.
    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }

    /// Sends the group's inventory (rank-agreed `Stored` / `Removed`, owner
    /// kvcr) to `sink`. Attach it on the rank that publishes (every rank's
    /// ledger is the same).
    pub fn set_inventory_sink(&self, sink: Box<dyn InventorySink>) {
        *lock(&self.sink) = Some(sink);
    }

    /// Registers the engine's host pool and starts this rank's runner over
    /// it. Registering the identical pool again is a no-op; a different one
    /// is refused.
    ///
    /// What can be checked is, before the runner starts: the description is
    /// plausible (a non-null base, a non-zero size that is exactly the
    /// geometry's, no wrap past the end of the address space) and, right now,
    /// every byte of `desc.base .. desc.base + desc.len` is mapped readable
    /// and writable in this process (`/proc/self/maps`; see the `mapping`
    /// module for what that snapshot cannot prove). Every call then checks
    /// each host page it names against this pool before anything is copied.
    ///
    /// # Safety
    /// `desc.base .. desc.base + desc.len` must be the engine's own buffer
    /// and stay valid for reads and writes until this backend is dropped (the
    /// mapping check above cannot see a later unmap), and the engine must not
    /// touch a host page named in a call until that call returns.
    #[allow(unsafe_code)]
    pub unsafe fn register_host_pool(&self, desc: HostPoolDesc) -> Result<()> {
        let _serial = lock(&self.register);
        if let Some(active) = self.active.get() {
            return if active.desc == desc {
                Ok(())
            } else {
                Err(Error::HostPoolReplaced)
            };
        }
        let plan = SpanPlan::new(&desc)?;
        mapping::check_host_memory(desc.base, desc.len)?;
        let runner = self.start_runner(&plan)?;
        let segments: Vec<NamespaceId> = (0..plan.segments.len())
            .map(|s| runner.register_namespace(self.segment_namespace(&desc, s)))
            .collect();
        let mut regions = Vec::with_capacity(plan.kinds.len());
        for region in plan.regions(desc.base) {
            // SAFETY: every region lies inside `desc.base .. desc.base +
            // desc.len` (checked by `SpanPlan::new`), which the caller
            // promises stays valid and untouched while calls are in flight,
            // for as long as this backend (and so the runner) lives.
            regions.push(unsafe { runner.register_region(region) }?);
        }
        runner.set_inventory_sink(Box::new(self.evictions.clone()));
        let endpoint = runner.peers().endpoint().cloned();
        *lock(&self.ledger) = Ledger::new(
            InventoryScope {
                owner: Owner::Kvcr,
                namespace: self.page_namespace,
                medium: self.backend.medium,
            },
            desc.geometry.page_size,
        );
        let active = Active {
            desc,
            plan,
            runner,
            regions,
            segments,
            endpoint,
        };
        // The publisher starts before the backend serves, so the attach
        // barrier precedes every page it publishes; a publisher that cannot
        // start fails the attach (the runner stops with `active`).
        self.start_publisher()?;
        // Set under `register`: nobody else can have set it.
        let _ = self.active.set(active);
        Ok(())
    }

    fn segment_namespace(&self, desc: &HostPoolDesc, segment: usize) -> Namespace {
        let g = &desc.geometry;
        let s = &self.storage;
        let geometry = [
            g.layers,
            g.kv_heads,
            g.head_dim,
            g.dtype_bytes,
            g.page_size,
            s.tp_size,
            s.tp_rank,
            s.attn_cp_size,
            s.attn_cp_rank,
        ]
        .map(u32::to_be_bytes)
        .concat();
        Namespace::base(CompatDigest(digest(&[
            b"kvcr-hicache-v1",
            s.model_name.as_bytes(),
            desc.layout.as_str().as_bytes(),
            &geometry,
            &(segment as u64).to_be_bytes(),
        ])))
    }

    fn start_runner(&self, plan: &SpanPlan) -> Result<Runner> {
        let b = &self.backend;
        let blocks = b.local_dram_bytes / plan.span_bytes.max(1);
        let spans = plan.spans_per_page() as u64;
        if blocks < spans {
            return Err(Error::config(
                "local_dram_bytes",
                format!(
                    "{} bytes hold less than one page ({} bytes)",
                    b.local_dram_bytes,
                    plan.span_bytes * spans
                ),
            ));
        }
        let blocks = u32::try_from(blocks.min(kvcr_foundation::runner::MAX_REGION_ELEMENTS))
            .unwrap_or(u32::MAX);
        let config = RunnerConfig {
            pools: vec![PoolConfig {
                name: POOL_NAME.to_owned(),
                block_size: plan.span_bytes,
                blocks,
            }],
            operation_timeout: b.operation_timeout,
            medium: b.medium,
            prefault: b.prefault,
            pool_memory: self.tuning.pool_memory.clone(),
            g3: b.g3.as_ref().map(|g3| kvcr_foundation::runner::G3Options {
                paths: g3.files(self.coordinate.global_offset()),
                capacity_bytes_per_file: g3.capacity_bytes_per_file,
            }),
            ..RunnerConfig::default()
        };
        // With G3, victims move to the file tier instead of being dropped.
        let policy: Box<dyn CachePolicy> = match (b.policy, b.g3.is_some()) {
            (EvictionPolicy::Lru, false) => Box::new(policy::Lru),
            (EvictionPolicy::Fifo, false) => Box::new(policy::Fifo),
            (EvictionPolicy::Lru, true) => Box::new(policy::G3Lru),
            (EvictionPolicy::Fifo, true) => Box::new(policy::G3Fifo),
        };
        if !b.enable_remote_hint {
            return Ok(Runner::start(config, Some(policy))?);
        }
        let options = PeerOptions {
            bind: b.bind_address(self.coordinate.global_offset())?,
            advertise_host: b.advertise_host()?,
            advertise_policy: b.advertise_policy(),
            secret: b.cluster_secret.as_ref().map(|s| s.expose().to_vec()),
            ucx_tls: b.ucx_tls.clone(),
            data_stream: b.data_stream,
            abandon_timeout: None,
            max_puts_in_flight: 0,
            put_split: self.tuning.put_split,
            // One guard group per rank; a claim for another model or page
            // geometry is refused by the guard.
            guard: b.guard.as_ref().map(|(socket, journal_bytes)| {
                let mut guard = kvcr_foundation::runner::GuardOptions::new(
                    socket,
                    u32::try_from(self.coordinate.global_offset()).unwrap_or(u32::MAX),
                    digest(&[
                        b"kvcr-hicache-guard-v1",
                        self.storage.model_name.as_bytes(),
                        &plan.span_bytes.to_be_bytes(),
                        &(plan.spans_per_page() as u64).to_be_bytes(),
                    ]),
                );
                guard.journal_bytes = *journal_bytes;
                guard
            }),
            keyless_sources: self.keyless_sources(),
            // The runner's defaults for everything this backend does not set.
            ..PeerOptions::loopback()
        };
        Ok(Runner::start_with_peers(config, Some(policy), &options)?)
    }

    /// Whether this rank follows hints naming no member key: as configured,
    /// else allowed for a worker of more than one rank (whose registration
    /// names only the DP owner's key), else the runner's default.
    fn keyless_sources(&self) -> KeylessSources {
        let ranks = u64::from(self.storage.dp_size)
            * u64::from(self.storage.tp_size)
            * u64::from(self.storage.attn_cp_size);
        match self.backend.keyless_sources {
            Some(policy) => policy,
            None if ranks > 1 => KeylessSources::Allowed,
            None => KeylessSources::default(),
        }
    }

    fn active(&self) -> Result<&Active> {
        self.active.get().ok_or(Error::NotRegistered)
    }

    /// Runs the local phase of `method`: an error or a panic becomes `None`
    /// and is counted.
    fn local<T>(&self, method: Method, f: impl FnOnce() -> Result<T>) -> Option<T> {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            self.faults.fire(method)?;
            f()
        }));
        let error = match outcome {
            Ok(Ok(v)) => return Some(v),
            Ok(Err(e)) => e,
            Err(payload) => {
                let text = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Error::Panic(text.chars().take(200).collect())
            }
        };
        let counter = match method {
            Method::BatchExists => &self.counters.faults_batch_exists,
            Method::BatchGet => &self.counters.faults_batch_get,
            Method::BatchSet => &self.counters.faults_batch_set,
        };
        bump(counter, 1);
        *lock(&self.last_error) = Some(format!("{}: {error}", method.as_str()));
        None
    }

    /// MIN-reduces per-page flags over `group`; a failed collective is all
    /// misses (on every rank: each sees the failure).
    fn agree(&self, group: &dyn RankGroup, local: &[bool]) -> Vec<bool> {
        let mut values: Vec<u64> = local.iter().map(|b| u64::from(*b)).collect();
        match group.all_reduce_min(&mut values) {
            Ok(()) => values.iter().map(|v| *v == 1).collect(),
            Err(e) => {
                bump(&self.counters.faults_collective, 1);
                *lock(&self.last_error) = Some(format!("collective: {e}"));
                vec![false; local.len()]
            }
        }
    }

    /// Registers the call's router hint under its request (dialling this
    /// rank's shard of the source) and returns the scope to query and fetch
    /// under; `None` when there is no usable hint.
    fn apply_hint(&self, active: &Active, runner: &Runner, extra: &ExtraInfo) -> Option<RequestId> {
        let Some(raw) = extra.router_hint.as_ref() else {
            // No hint with this call: the request's earlier hint, if it is
            // still live, keeps covering its pages.
            let request = extra.request_id.as_ref()?;
            return lock(&self.hints)
                .live
                .contains(request)
                .then(|| request.clone());
        };
        if !self.backend.enable_remote_hint {
            bump(&self.counters.hints_ignored, 1);
            return None;
        }
        let parsed = match raw {
            Value::String(text) => parse_router_hint(text),
            other => parse_router_hint(&other.to_string()),
        };
        let mut hint = match parsed {
            Ok(h) => h,
            Err(e) => {
                bump(&self.counters.hints_rejected, 1);
                *lock(&self.last_error) = Some(format!("router hint: {e}"));
                return None;
            }
        };
        // The router names the source DP group's endpoint; this rank dials
        // the same within-DP offset there, so it reads its own shard.
        hint.source = match self.coordinate.dial(&hint.source) {
            Ok(e) => e,
            Err(e) => {
                bump(&self.counters.hints_rejected, 1);
                *lock(&self.last_error) = Some(format!("router hint source: {e}"));
                return None;
            }
        };
        if active
            .endpoint
            .as_ref()
            .is_some_and(|own| own.same_address(&hint.source))
        {
            return None;
        }
        let mut scopes = lock(&self.hints);
        let request = match &extra.request_id {
            Some(r) => r.clone(),
            None => {
                scopes.next_anonymous += 1;
                RequestId(format!("kvcr-hicache-anonymous-{}", scopes.next_anonymous))
            }
        };
        runner.hints().submit(request.clone(), &hint);
        if !scopes.live.contains(&request) {
            scopes.live.push_back(request.clone());
        }
        while scopes.live.len() > self.backend.max_hinted_requests {
            if let Some(old) = scopes.live.pop_front() {
                runner.hints().discard(&old);
            }
        }
        Some(request)
    }

    fn end_anonymous_scope(&self, runner: &Runner, extra: &ExtraInfo, scope: &Option<RequestId>) {
        if let (None, Some(request)) = (&extra.request_id, scope) {
            runner.hints().discard(request);
            lock(&self.hints).live.retain(|r| r != request);
        }
    }

    /// Ends a request's hint scope (call when the request finishes).
    pub fn discard_request(&self, request: &RequestId) {
        if let Some(active) = self.active.get() {
            active.runner.hints().discard(request);
        }
        lock(&self.hints).live.retain(|r| r != request);
    }

    /// How many leading `keys` this rank group can serve: every page's every
    /// segment is resident here or covered by the request's hint, on every
    /// rank (MIN-reduced). Hinted pages count optimistically; `batch_get`
    /// reports what really arrived.
    pub fn batch_exists(&self, keys: &[BlockKey], extra: &ExtraInfo) -> usize {
        let local = self
            .local(Method::BatchExists, || self.local_exists(keys, extra))
            .unwrap_or(0);
        let mut count = [local as u64];
        match self.groups.prefetch.all_reduce_min(&mut count) {
            Ok(()) => usize::try_from(count[0]).unwrap_or(0).min(keys.len()),
            Err(e) => {
                bump(&self.counters.faults_collective, 1);
                *lock(&self.last_error) = Some(format!("collective: {e}"));
                0
            }
        }
    }

    fn local_exists(&self, keys: &[BlockKey], extra: &ExtraInfo) -> Result<usize> {
        let active = self.active()?;
        let runner = &active.runner;
        let scope = self.apply_hint(active, runner, extra);
        let mut count = 0;
        'keys: for key in keys {
            for scoped in active.scoped(*key) {
                let status = match &scope {
                    Some(request) => runner.hints().query(request, &scoped),
                    None => runner.query(&scoped),
                };
                if status == QueryStatus::Miss {
                    break 'keys;
                }
            }
            count += 1;
        }
        self.end_anonymous_scope(runner, extra, &scope);
        Ok(count)
    }

    /// Restores `keys` into host pages `host_pages` (one page index per key):
    /// from KVCR DRAM, or from the hinted peer. `true` for a page every rank
    /// restored.
    pub fn batch_get(&self, keys: &[BlockKey], host_pages: &[u64], extra: &ExtraInfo) -> Vec<bool> {
        let local = self
            .local(Method::BatchGet, || self.local_get(keys, host_pages, extra))
            .unwrap_or_else(|| vec![false; keys.len()]);
        let agreed = self.agree(self.groups.prefetch.as_ref(), &local);
        bump(
            &self.counters.pages_restored,
            agreed.iter().filter(|b| **b).count() as u64,
        );
        agreed
    }

    /// Refuses a call before it copies anything: lengths that differ, a host
    /// page outside the registered pool (or whose spans would run past it),
    /// or a host page named twice ([`Error::DuplicateHostPage`]).
    fn check_batch(&self, active: &Active, keys: &[BlockKey], host_pages: &[u64]) -> Result<()> {
        if keys.len() != host_pages.len() {
            return Err(Error::Batch(format!(
                "{} keys but {} host pages",
                keys.len(),
                host_pages.len()
            )));
        }
        active.plan.check_host_pages(active.desc.len, host_pages)
    }

    fn local_get(
        &self,
        keys: &[BlockKey],
        host_pages: &[u64],
        extra: &ExtraInfo,
    ) -> Result<Vec<bool>> {
        let active = self.active()?;
        self.check_batch(active, keys, host_pages)?;
        let segments = active.segments.len();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        // A key named twice (two requests restoring one page into two host
        // pages) goes in a later wave, after the first copy made it resident.
        let mut waves: Vec<Vec<usize>> = Vec::new();
        let mut seen: HashMap<BlockKey, usize> = HashMap::new();
        for (i, key) in keys.iter().enumerate() {
            let n = seen.entry(*key).or_insert(0);
            if let Some(wave) = waves.get_mut(*n) {
                wave.push(i);
            } else {
                waves.push(vec![i]);
            }
            *n += 1;
        }
        let mut ok = vec![false; keys.len()];
        let mut scope = None;
        for wave in waves {
            let (op, hinted) = {
                let runner = &active.runner;
                if scope.is_none() {
                    scope = self.apply_hint(active, runner, extra);
                }
                let mut hinted = Vec::new();
                let mut entries = Vec::with_capacity(wave.len() * segments);
                for &i in &wave {
                    let (Some(key), Some(page)) = (keys.get(i), host_pages.get(i)) else {
                        continue;
                    };
                    let mut remote = false;
                    for (s, scoped) in active.scoped(*key).enumerate() {
                        if let Some(request) = &scope {
                            remote |= matches!(
                                runner.hints().query(request, &scoped),
                                QueryStatus::Fetchable(_)
                            );
                        }
                        entries.push(DeliverEntry {
                            key: scoped,
                            destinations: active.elements(s, *page),
                        });
                    }
                    if remote {
                        hinted.push(i);
                    }
                }
                let op = match &scope {
                    Some(request) => runner.hints().deliver(request, entries)?,
                    None => runner.deliver(entries)?,
                };
                (op, hinted)
            };
            bump(&self.counters.hinted_pages_requested, hinted.len() as u64);
            let result = active.finish_op(
                op,
                self.backend.get_timeout,
                self.backend.operation_timeout,
                &self.counters.ops_abandoned,
            );
            let Some(result) = result else {
                let runner = &active.runner;
                self.end_anonymous_scope(runner, extra, &scope);
                return Err(Error::Timeout(self.backend.get_timeout.as_millis() as u64));
            };
            for (w, &i) in wave.iter().enumerate() {
                let all = result
                    .entries
                    .get(w * segments..(w + 1) * segments)
                    .is_some_and(|e| e.len() == segments && e.iter().all(|(_, r)| r.is_success()));
                if let Some(slot) = ok.get_mut(i) {
                    *slot = all;
                }
            }
            let loaded = hinted
                .iter()
                .filter(|i| ok.get(**i).copied().unwrap_or(false))
                .count();
            bump(&self.counters.hinted_pages_loaded, loaded as u64);
        }
        let runner = &active.runner;
        self.end_anonymous_scope(runner, extra, &scope);
        Ok(ok)
    }

    /// Stores host pages `host_pages` under `keys` in KVCR DRAM (write-through
    /// backup). `true` for a page every rank committed; such pages are
    /// published once (with `extra.pages` tokens). Before and after the
    /// copy, every rank's evictions are gathered and published as `Removed`
    /// (so a page this call evicted on any rank is withdrawn by its return).
    pub fn batch_set(&self, keys: &[BlockKey], host_pages: &[u64], extra: &ExtraInfo) -> Vec<bool> {
        self.exchange_evictions();
        let local = self
            .local(Method::BatchSet, || self.local_set(keys, host_pages))
            .unwrap_or_else(|| vec![false; keys.len()]);
        let agreed = self.agree(self.groups.backup.as_ref(), &local);
        let committed = agreed.iter().filter(|b| **b).count() as u64;
        bump(&self.counters.pages_committed, committed);
        if committed > 0 {
            let (events, unpublished) =
                lock(&self.ledger).stored(keys, &agreed, extra.pages.as_ref());
            bump(&self.counters.pages_unpublished, unpublished as u64);
            self.publish(events);
        }
        // Pages this call's deposits evicted (on any rank) are withdrawn now,
        // not at the next call: a router must not keep hinting a page for a
        // whole backup interval after one shard of it is gone.
        self.exchange_evictions();
        agreed
    }

    fn local_set(&self, keys: &[BlockKey], host_pages: &[u64]) -> Result<Vec<bool>> {
        let active = self.active()?;
        self.check_batch(active, keys, host_pages)?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let segments = active.segments.len();
        // Keys are unique per call (a page is stored once, from its first
        // host copy); repeats share the first one's outcome.
        let mut first: HashMap<BlockKey, usize> = HashMap::new();
        let mut unique = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            first.entry(*key).or_insert_with(|| {
                unique.push(i);
                unique.len() - 1
            });
        }
        let op = {
            let runner = &active.runner;
            let mut entries = Vec::with_capacity(unique.len() * segments);
            for &i in &unique {
                let (Some(key), Some(page)) = (keys.get(i), host_pages.get(i)) else {
                    continue;
                };
                for (s, scoped) in active.scoped(*key).enumerate() {
                    entries.push(DepositEntry {
                        key: scoped,
                        spans: active.elements(s, *page),
                        page: None,
                    });
                }
            }
            runner.deposit(entries, false)?
        };
        let result = active
            .finish_op(
                op,
                self.backend.get_timeout,
                self.backend.operation_timeout,
                &self.counters.ops_abandoned,
            )
            .ok_or(Error::Timeout(self.backend.get_timeout.as_millis() as u64))?;
        let stored: Vec<bool> = (0..unique.len())
            .map(|u| {
                result
                    .entries
                    .get(u * segments..(u + 1) * segments)
                    .is_some_and(|e| e.len() == segments && e.iter().all(|(_, r)| r.is_success()))
            })
            .collect();
        Ok(keys
            .iter()
            .map(|k| {
                first
                    .get(k)
                    .and_then(|u| stored.get(*u))
                    .copied()
                    .unwrap_or(false)
            })
            .collect())
    }

    /// Gathers every rank's evictions since the last exchange and publishes
    /// `Removed` for the published pages among them (a collective on the
    /// backup group; `batch_set` runs it first). Call it on every rank.
    pub fn sync_inventory(&self) {
        self.exchange_evictions();
    }

    fn exchange_evictions(&self) {
        let local: Vec<BlockKey> = {
            let mut pending = lock(&self.evictions.pending);
            let n = pending.len().min(MAX_EVICTIONS_PER_ROUND);
            pending.drain(..n).collect()
        };
        let raw: Vec<u64> = local.iter().map(|k| k.as_u64()).collect();
        match self.groups.backup.all_gather(&raw) {
            Ok(all) => {
                let union: Vec<BlockKey> =
                    all.into_iter().flatten().map(BlockKey::from_u64).collect();
                let event = lock(&self.ledger).removed(union);
                if let Some(event) = event {
                    self.publish(vec![event]);
                }
            }
            Err(e) => {
                // Keep them for the next round: an eviction is never lost.
                bump(&self.counters.faults_collective, 1);
                *lock(&self.last_error) = Some(format!("collective: {e}"));
                let mut pending = lock(&self.evictions.pending);
                let rest = std::mem::take(&mut *pending);
                *pending = local;
                pending.extend(rest);
            }
        }
    }

    fn publish(&self, events: Vec<InventoryEvent>) {
        for event in &events {
            match event {
                InventoryEvent::Stored { keys, .. } => {
                    bump(&self.counters.pages_published, keys.len() as u64);
                }
                InventoryEvent::Removed { keys, .. } => {
                    bump(&self.counters.pages_removed, keys.len() as u64);
                }
                InventoryEvent::AllCleared { .. } => {}
            }
        }
        if let Some(sink) = lock(&self.sink).as_mut() {
            for event in &events {
                sink.publish(event);
            }
        }
    }

    /// The published pages removed since the last call (for engines that
    /// publish inventory themselves); a second call returns nothing new.
    pub fn take_removed_page_hashes(&self) -> Vec<BlockKey> {
        lock(&self.ledger).take_removed()
    }

    /// Whether the group has published `key` as stored (and not removed).
    pub fn is_published(&self, key: BlockKey) -> bool {
        lock(&self.ledger).is_published(&key)
    }

    /// Pages published as stored and not removed.
    pub fn published_pages(&self) -> usize {
        lock(&self.ledger).published_len()
    }

    /// Counters of this rank.
    pub fn stats(&self) -> StorageStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StorageStats {
            faults_batch_exists: get(&c.faults_batch_exists),
            faults_batch_get: get(&c.faults_batch_get),
            faults_batch_set: get(&c.faults_batch_set),
            faults_collective: get(&c.faults_collective),
            hints_rejected: get(&c.hints_rejected),
            hints_ignored: get(&c.hints_ignored),
            hinted_pages_requested: get(&c.hinted_pages_requested),
            hinted_pages_loaded: get(&c.hinted_pages_loaded),
            pages_restored: get(&c.pages_restored),
            pages_committed: get(&c.pages_committed),
            pages_published: get(&c.pages_published),
            pages_removed: get(&c.pages_removed),
            pages_unpublished: get(&c.pages_unpublished),
            ops_abandoned: get(&c.ops_abandoned),
            last_error: lock(&self.last_error).clone(),
        }
    }

    /// The runner's state (once registered).
    pub fn runner_stats(&self) -> Option<RunnerStats> {
        self.active.get().map(|a| a.runner.stats())
    }

    /// The runner's G3 state (with `g3_paths`, once registered).
    pub fn runner_g3_stats(&self) -> Option<kvcr_foundation::runner::G3Stats> {
        self.active.get().and_then(|a| a.runner.pools().g3_stats())
    }

    /// The runner's peer counters (peer mode, once registered).
    pub fn peer_counters(&self) -> Option<PeerCounters> {
        self.active
            .get()
            .filter(|a| a.endpoint.is_some())
            .map(|a| a.runner.peers().stats().counters)
    }

    /// Checks the runner's structural invariants (tests and debugging).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        match self.active.get() {
            Some(a) => a.runner.check_invariants(),
            None => Ok(()),
        }
    }
}

/// Parses a router hint's text as the backend does: an object with
/// `protocol_version` or `actions`, or text that is not a JSON object, is a
/// versioned envelope (`kv.fetch@1.0`); any other object is the legacy
/// compact form.
pub fn parse_router_hint(text: &str) -> kvcr_foundation::Result<FetchHint> {
    let looks_versioned = serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| {
            v.as_object()
                .map(|o| o.contains_key("protocol_version") || o.contains_key("actions"))
        })
        .unwrap_or(true);
    if looks_versioned {
        FetchHint::from_json(text)
    } else {
        FetchHint::from_legacy_json(text)
    }
}
