//! kvcr-runner: the rank-local runner. KVCR-owned DRAM, the block index,
//! claims, eviction, local data movement and the peer path.
//!
//! [`Runner`] is the driver around the sans-I/O core (`kvcr-runner-core`): the core decides
//! (index, residencies, claims, eviction, deadlines, inventory); the driver owns
//! the DRAM pools and a copy thread and executes the core's copy actions.
//!
//! ```text
//!  caller ── deposit / fetch / deliver / release / abort ──► Core ──► Action::Copy ──► copy thread
//!    ▲                                                        ▲                          │
//!    └──────── wait(op) / poll_completed / wait_completed ◄───┴──── copy outcomes ◄──────┘
//! ```
//!
//! Addressing is by registered region plus element index: the engine registers
//! its host (or pinned) regions with [`Runner::register_region`], labelled by
//! pool name, and names memory only as [`ElementRef`](kvcr_contracts::protocol::ElementRef)s.
//!
//! Completion semantics: an operation completes once every key has a result and
//! every copy it started is terminal, so after a deposit completes its source
//! buffers may be reused, and after a deliver completes its destinations hold
//! the bytes (for `Success` keys).

#![deny(unsafe_code)]

pub use self::net::client;
mod config;
mod contention;
/// Test support: the UCX active-message id of a write message (the
/// hostile-member tests forge them).
#[doc(hidden)]
pub use self::wire::record::WRITE_MESSAGE as WRITE_MESSAGE_ID;
#[doc(hidden)]
pub use contention::force_contended;
mod copy;
pub mod error;
mod facets;
pub mod g3;
pub mod guard;
mod local_users;
mod net;
mod peer;
/// The one module with `unsafe`: where an engine hands the runner raw
/// memory (`Runner::register_region`, `Runner::register_device_region`).
#[allow(unsafe_code)]
mod register;
mod shared;
mod startup;
mod stats;
#[cfg(test)]
mod tests;
pub mod timeline;
mod warm;
mod wire;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvcr_runner_core::Core;
pub use kvcr_runner_core::policy;
pub use kvcr_runner_core::{
    CachePolicy, ClaimedCopy, CopySpan, CoreCounters, DeliverEntry, DepositEntry, EntryResult,
    EntryStatus, FailReason, G3Counters, KVCR_REGION_PREFIX, MAX_REGION_ELEMENTS, MAX_REGION_LABEL,
    MAX_SPANS_PER_KEY, OpResult, PageInfo, PeerCounters, PeerNotice, PeerStateSizes, PoolConfig,
    PoolId, PoolRange, PoolStats, QueryStatus, RegionDesc, RegionMemory, ReleaseHandle,
    RouteBudget, RunnerStats,
};

pub use self::config::{
    DataStream, GuardOptions, MAX_POOL_BYTES, PeerOptions, PutSplit, RunnerConfig, StreamSealing,
};
pub use self::copy::device::{DeviceCopier, DeviceImport, MAX_DEVICE_EXPORT};
pub use self::error::{Error, Result};
pub use self::facets::{Hints, Peers, Pools, Recovery};
pub use self::g3::{G3Error, G3Options, G3Store};
pub use self::net::{ControlCounters, ControlLimits, KeylessSources, StaticKey};
pub use self::peer::landing::LandingCheck;
use self::shared::{CapacityCallback, Shared};
use self::startup::StartupStage;
pub use self::stats::{G3Stats, PeerStats};
pub use self::warm::WarmStart;
use crate::error::RunnerReason;
use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::key::{Namespace, NamespaceId, ScopedKey};
use kvcr_contracts::protocol::{OpHandle, RegionId};
use kvcr_contracts::tier::InventorySink;
pub use kvcr_runner_core::RecoveryReport;
pub use kvcr_runner_core::journal::JournalStats;
pub use kvcr_sys::placement::{
    AnonymousMemory, HugePages, MAX_NUMA_NODE, NumaBinding, NumaMode, PlacementDowngrade,
    PlacementOutcome, PoolMemory, PoolMemoryInfo, online_nodes, shared_memory_huge_pages,
    transparent_huge_page_mode,
};

/// Test support: bytes of KVCR DRAM currently allocated by all runners in
/// this process (a leak check: it returns to its old value after a runner is
/// closed or a startup fails).
#[doc(hidden)]
pub fn process_pool_bytes() -> u64 {
    kvcr_sys::mapping::live_pool_bytes()
}

/// The rank-local runner.
///
/// Threads: the caller's thread runs the API; a copy thread executes copies
/// and applies their outcomes to the shared core (so operations complete
/// without polling). The sink and the capacity callback run on either thread,
/// under the runner's lock: they must not call back into the runner.
///
/// The runner keeps the engine's operations; the rest it hands out as
/// facets: [`hints`](Self::hints) (operations under a router hint),
/// [`peers`](Self::peers) (the peer protocol's controls and counters) and
/// [`pools`](Self::pools) (its DRAM pools, device copier and G3 tier).
///
/// Drop order is load-bearing: `copy` is declared before `pools`, so dropping a
/// runner stops and joins the copy thread before the pools it copies into and
/// out of are freed.
pub struct Runner {
    copy: copy::CopyEngine,
    /// Owns the registered pool memory in peer mode; stopped after `copy`.
    peer: Option<peer::PeerDriver>,
    shared: Arc<Shared>,
    /// Owns the local-mode pool memory the core addresses, registered for
    /// copies; never read, only freed (unregistered first), and only after
    /// the copy thread has stopped.
    #[allow(dead_code)]
    pools: Vec<kvcr_sys::RegisteredMemory>,
    incarnation: Incarnation,
    endpoint: Option<ControlEndpoint>,
    /// Our UCX worker's address, as every source we dial receives it.
    worker_address: Option<Vec<u8>>,
    pool_bytes: u64,
    pool_memory: Vec<PoolMemoryInfo>,
    /// The device copier, set at most once, detached in `drop` between steps
    /// 1 and 2.
    device: std::sync::OnceLock<Arc<dyn DeviceCopier>>,
    /// The guard's lease on this runner's group (released in `drop` once
    /// nothing can write the pools any more).
    guard: Option<guard::GuardLease>,
    /// How the runner started under its guard.
    warm_start: Option<WarmStart>,
}

// The engine's threads share one runner (`&self` API, state behind its lock).
const _: () = {
    const fn shared_between_threads<T: Send + Sync>() {}
    shared_between_threads::<Runner>();
};

impl Drop for Runner {
    fn drop(&mut self) {
        // 1. No local copy runs after this (queued ones are skipped).
        self.copy.stop();
        // 1a. Nor any G3 transfer: the store's workers finish what was
        //     submitted (reporting it to the core) and are joined here, with
        //     the runner's lock not held (their reports take it).
        let g3 = self.shared.lock().g3.take();
        drop(g3);
        // 1b. No device copy runs either (they run on the copy thread), so the
        //     copier may unpin the pools before anything below frees them.
        if let Some(copier) = self.device.take() {
            copier.detach(&self.shared.lock().core.pool_ranges());
        }
        // 2. The peer thread unmaps the pools it registered, unless a remote
        //    write might still land in them: then it keeps them mapped for the
        //    life of the process rather than risk a write into reused memory.
        if let Some(peer) = self.peer.as_mut() {
            let (targets, writes) = self.shared.lock().core.peer_busy();
            let leak = targets > 0 || writes > 0;
            if leak {
                eprintln!(
                    "kvcr: dropping a runner with {targets} remote writes unresolved; its pools stay mapped until exit"
                );
            }
            peer.stop(leak);
            // 2a. The group goes back to the guard for the next incarnation,
            //     unless a remote write may still land in its pools: then
            //     the lease ends with this process, as the mapping does.
            if let Some(lease) = self.guard.take()
                && !leak
                && let Err(e) = lease.release()
            {
                eprintln!("kvcr: releasing the guard's group failed: {e}");
            }
        }
        // 3. `pools` (local mode) are freed when the fields drop, after both.
    }
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("incarnation", &self.incarnation)
            .field("core", &self.shared.lock().core)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// Starts a runner: validates the configuration, allocates (and by default
    /// pre-faults) the pools, and starts the copy thread. All or nothing: a
    /// failure at any stage releases what earlier stages acquired, and the
    /// error names the stage.
    pub fn start(config: RunnerConfig, policy: Option<Box<dyn CachePolicy>>) -> Result<Self> {
        Self::start_staged(config, policy, None)
    }

    pub(crate) fn start_staged(
        config: RunnerConfig,
        policy: Option<Box<dyn CachePolicy>>,
        fail_at: Option<StartupStage>,
    ) -> Result<Self> {
        let mut runner = Self::from_started(startup::local(config, policy, fail_at)?);
        if let Err(e) = startup::injected(fail_at, StartupStage::StartCopyEngine) {
            runner.copy.stop();
            return Err(e);
        }
        Ok(runner)
    }

    /// Starts a runner that also takes part in the peer protocol: its pools
    /// are registered with UCX (on the peer thread, which owns them), its
    /// control channel listens where `peer` says, and hinted fetches pull
    /// from peers. Stages as [`Runner::start`], plus "start peer".
    pub fn start_with_peers(
        config: RunnerConfig,
        policy: Option<Box<dyn CachePolicy>>,
        peer: &PeerOptions,
    ) -> Result<Self> {
        startup::with_peers(config, policy, peer, None).map(Self::from_started)
    }

    /// The runner over what a start-up path made.
    fn from_started(started: startup::Started) -> Self {
        Self {
            copy: started.copy,
            peer: started.peer,
            shared: started.shared,
            pools: started.pools,
            incarnation: started.incarnation,
            endpoint: started.endpoint,
            worker_address: started.worker_address,
            pool_bytes: started.pool_bytes,
            pool_memory: started.pool_memory,
            device: std::sync::OnceLock::new(),
            guard: started.guard,
            warm_start: started.warm_start,
        }
    }

    /// Sends inventory events (owner KVCR, tier KVCR DRAM) to `sink`.
    ///
    /// A runner that recovered pages from its guard first sends the
    /// `AllCleared` barrier of its incarnation and then every recovered page
    /// still resident, once (to the first sink set): a router drops what
    /// the dead incarnation published and converges on what this one holds.
    pub fn set_inventory_sink(&self, mut sink: Box<dyn InventorySink>) {
        let mut inner = self.shared.lock();
        let recovered = inner.core.recovered_stored_events();
        if self
            .warm_start
            .as_ref()
            .is_some_and(|w| w.recovery.as_ref().is_some_and(|r| r.seated > 0))
        {
            sink.publish(&kvcr_contracts::tier::InventoryEvent::AllCleared {
                owner: kvcr_contracts::tier::Owner::Kvcr,
                incarnation: self.incarnation,
            });
            for event in &recovered {
                sink.publish(event);
            }
        }
        inner.sink = Some(sink);
    }

    /// Calls `callback` with `(pool, watermark slots)` when pools newly drop
    /// below their low watermark (edge-triggered).
    pub fn set_capacity_needed(&self, callback: CapacityCallback) {
        self.shared.lock().capacity_needed = Some(callback);
    }

    /// This runner's incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// The id of a registered region.
    pub fn region(&self, label: &str) -> Option<RegionId> {
        self.shared.lock().core.region_by_label(label)
    }

    /// Registers a namespace so its keys can be used and its LoRA name published.
    pub fn register_namespace(&self, namespace: Namespace) -> NamespaceId {
        self.shared.lock().core.register_namespace(namespace)
    }

    /// A pool by name.
    pub fn pool(&self, name: &str) -> Option<PoolId> {
        self.shared.lock().core.pool_id(name)
    }

    /// Runs `f` on the core under the lock, then pumps its actions.
    /// A core call whose refusal becomes the runner's error.
    fn core_call<T>(
        &self,
        f: impl FnOnce(&mut Core, u64) -> kvcr_runner_core::Result<T>,
    ) -> Result<T> {
        self.with_core(f).map_err(Error::from)
    }

    fn with_core<T>(&self, f: impl FnOnce(&mut Core, u64) -> T) -> T {
        self.shared.with_core_now(f)
    }

    /// Copies framework elements into KVCR DRAM. With `no_evict`, each stored
    /// key also gets a claim (release it later). Validation errors refuse the
    /// whole call, unchanged.
    pub fn deposit(&self, entries: Vec<DepositEntry>, no_evict: bool) -> Result<OpHandle> {
        self.core_call(|core, now| core.deposit(now, entries, no_evict))
    }

    /// Claims resident keys (deduplicated, in order) and returns their KVCR
    /// elements; `layout` is the pools of one key's spans, in order.
    pub fn fetch(&self, keys: &[ScopedKey], layout: &[PoolId]) -> Result<OpHandle> {
        self.core_call(|core, now| core.fetch(now, keys, layout, None))
    }

    /// Copies resident (or filling) keys into framework elements.
    pub fn deliver(&self, entries: Vec<DeliverEntry>) -> Result<OpHandle> {
        self.core_call(|core, now| core.deliver(now, entries, None))
    }

    /// Releases public claims: `true` per live handle, `false` for unknown or
    /// already released ones.
    pub fn release(&self, handles: &[ReleaseHandle]) -> Vec<bool> {
        self.with_core(|core, _| core.release(handles))
    }

    /// Best-effort abort (see the core's rules); `true` if anything changed.
    pub fn abort(&self, op: OpHandle, keys: Option<&[ScopedKey]>) -> bool {
        self.with_core(|core, _| core.abort(op, keys))
    }

    /// Residency of one key: no I/O, no allocation.
    pub fn query(&self, key: &ScopedKey) -> QueryStatus {
        self.shared.lock().core.query(key)
    }

    /// The page digest of `key` (xxh3-64 of its bytes in layout order,
    /// taken at deposit, or the source's for a page restored from a peer),
    /// if it is READY here and has one: a consumer may check the bytes it
    /// reads against it.
    pub fn page_digest(&self, key: &ScopedKey) -> Option<u64> {
        self.shared.lock().core.page_digest(key)
    }

    /// Turns taking page digests at deposit on or off (default on). For the
    /// benchmarks' comparison only: pages deposited while off carry none,
    /// and a destination checks only pages that come with one.
    #[doc(hidden)]
    pub fn set_page_digests(&self, on: bool) {
        self.shared.lock().core.set_page_digests(on);
    }

    /// Residency of many keys into `out` (same length), under one lock: no
    /// I/O, no allocation.
    pub fn query_into(&self, keys: &[ScopedKey], out: &mut [QueryStatus]) {
        let inner = self.shared.lock();
        for (key, slot) in keys.iter().zip(out.iter_mut()) {
            *slot = inner.core.query(key);
        }
    }

    /// Copies span `span` of a claimed page into `out` (which must be the
    /// span's length).
    pub fn read_claimed(&self, handle: ReleaseHandle, span: usize) -> Result<Vec<u8>> {
        let inner = self.shared.lock();
        let refs = inner
            .core
            .claimed_slot_refs(handle)
            .ok_or(Error::runner(RunnerReason::UnknownClaim(handle.0)))?;
        let element = refs
            .get(span)
            .ok_or(Error::runner(RunnerReason::LayoutMismatch))?;
        let (addr, len) = inner.core.resolve(*element)?;
        // The element is a slot of a runner-owned pool (bounds-checked by
        // `resolve`, and by the registry); the claim keeps the page READY,
        // READY slots are never written (fills write only FILLING slots), and
        // the lock keeps the claim from being released while we copy.
        Ok(self.shared.memory.read(addr, len)?)
    }

    /// Expires deadlines and returns completed operations. Never blocks.
    pub fn poll_completed(&self) -> Vec<OpResult> {
        let mut inner = self.shared.lock();
        self.shared.expire(&mut inner);
        self.shared.completed_len.store(0, Ordering::Release);
        std::mem::take(&mut inner.completed)
    }

    /// Leading spans of a page that make up its first layer (a
    /// layer-first layout's K and V of layer 0: 2). A deliver into device
    /// regions then copies them first and reports them landed, as does a
    /// one-hop write's source ([`Self::poll_leads_landed`]). 0 (the
    /// default): never.
    pub fn set_lead_elements(&self, elements: u16) {
        self.shared.lock().core.set_lead_elements(elements);
    }

    /// Device delivers whose first layer is in place, each with how many
    /// leading pages that covers, in the order they became so; taken once
    /// (the newest 4096 untaken are kept). Only with
    /// [`Self::set_lead_elements`], where the device copier or a one-hop
    /// write's source said a lead landed: an engine may start those pages'
    /// first layer, but the deliver's result alone says which pages landed
    /// and passed the check (a page here may still fail, and its work must
    /// then be thrown away).
    pub fn poll_leads_landed(&self) -> Vec<(OpHandle, u32)> {
        let mut inner = self.shared.lock();
        self.shared.expire(&mut inner);
        self.shared.take_copy_leads(&mut inner);
        let fresh = inner.core.drain_leads_landed();
        inner.leads_landed.extend(fresh);
        std::mem::take(&mut inner.leads_landed)
    }

    /// Like [`Self::poll_completed`], but waits up to `timeout` for something
    /// to complete when nothing has yet (waking for deadlines on the way).
    pub fn wait_completed(&self, timeout: Duration) -> Vec<OpResult> {
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        self.shared.spin_for_completion(start);
        loop {
            let out = self.poll_completed();
            let elapsed = start.elapsed();
            if !out.is_empty() || elapsed >= timeout {
                return out;
            }
            let inner = self.shared.lock();
            if !inner.completed.is_empty() {
                continue;
            }
            let idle = inner.core.jobs_in_flight() == 0 && inner.core.next_deadline().is_none();
            if idle {
                return Vec::new();
            }
            drop(self.shared.sleep_for_progress(inner, timeout - elapsed));
        }
    }

    /// Waits up to `timeout` for operation `op` and returns its result,
    /// leaving every other completed operation to its own waiter: several
    /// threads may each wait for their own operations on one runner.
    ///
    /// `Ok(None)`: `op` had not completed when `timeout` passed (wait again, or
    /// abort it). Refused with `RunnerReason::UnknownOperation` when `op` is
    /// neither in flight nor waiting to be taken: never issued, or its result
    /// was taken already, by `wait` or by
    /// [`poll_completed`](Self::poll_completed) /
    /// [`wait_completed`](Self::wait_completed), which take every result (a
    /// caller that uses those owns every operation of the runner).
    pub fn wait(&self, op: OpHandle, timeout: Duration) -> Result<Option<OpResult>> {
        #[allow(clippy::disallowed_methods)]
        let start = Instant::now();
        // A zero timeout is a poll: no spin.
        if !timeout.is_zero() {
            self.shared.spin_for_completion(start);
        }
        let mut inner = self.shared.lock();
        loop {
            self.shared.expire(&mut inner);
            if let Some(pos) = inner.completed.iter().position(|r| r.op == op) {
                let result = inner.completed.remove(pos);
                self.shared
                    .completed_len
                    .store(inner.completed.len(), Ordering::Release);
                return Ok(Some(result));
            }
            if !inner.core.op_pending(op) {
                return Err(Error::runner(RunnerReason::UnknownOperation(op.0)));
            }
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                return Ok(None);
            }
            inner = self.shared.sleep_for_progress(inner, timeout - elapsed);
        }
    }

    /// Copies runs of bytes out of KVCR DRAM slots that `handles` (claims
    /// from `fetch`) hold into framework host elements, in the caller's thread,
    /// without a copy job: the fast path for restores whose adjacent pages
    /// move as one copy ([`ClaimedCopy`] says how a run may span elements).
    /// Validated whole first: a refusal copies nothing. The records stay
    /// pinned during the copy, so a claim released meanwhile by another
    /// thread cannot free the bytes being read; the claims themselves stay
    /// the caller's to release.
    pub fn copy_claimed(&self, handles: &[ReleaseHandle], copies: &[ClaimedCopy]) -> Result<()> {
        let (spans, pinned) = self.core_call(|core, _| core.pin_claimed_copy(handles, copies))?;
        // The sources are slots of READY records pinned above (an internal
        // claim each, so not evicted or refilled until `unpin`); the
        // destinations are framework host elements bounds-checked by the core
        // against their registrations, which the caller promised untouched
        // while an operation names them (`register_region`); the registry
        // checks every span again.
        let copied = copy::copy_plan(&self.shared.memory, &spans);
        self.with_core(|core, _| core.unpin(&pinned));
        Ok(copied?)
    }

    /// Nobody will wait for `op`: its result is dropped when it completes (or
    /// now, if it has completed and was not taken). For a caller that gave up
    /// on an operation (after an abort that did not finish in time) and uses
    /// [`wait`](Self::wait), so results never pile up. Unknown handles are
    /// ignored.
    pub fn discard_result(&self, op: OpHandle) {
        let mut inner = self.shared.lock();
        if let Some(pos) = inner.completed.iter().position(|r| r.op == op) {
            inner.completed.remove(pos);
            self.shared
                .completed_len
                .store(inner.completed.len(), Ordering::Release);
        } else if inner.core.op_pending(op) {
            inner.discarded.insert(op);
        }
    }

    /// Test support: checks the core's structural invariants (for tests and
    /// debugging; it walks the whole index under the lock).
    #[doc(hidden)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.shared.lock().core.check_invariants()
    }

    /// Shuts down. Refused (the runner is handed back unchanged) while copies
    /// are in flight or public claims are held: memory someone may still touch
    /// is never released.
    pub fn close(self) -> std::result::Result<(), (Box<Self>, Error)> {
        let _ = self.poll_completed();
        let (copies, claims, (targets, writes)) = {
            let inner = self.shared.lock();
            (
                inner.core.jobs_in_flight(),
                inner.core.public_claims(),
                inner.core.peer_busy(),
            )
        };
        let copies = copies + targets + writes;
        if copies > 0 {
            return Err((Box::new(self), Error::runner(RunnerReason::Busy(copies))));
        }
        if claims > 0 {
            return Err((
                Box::new(self),
                Error::runner(RunnerReason::ClaimsOutstanding(claims)),
            ));
        }
        drop(self);
        Ok(())
    }
}
