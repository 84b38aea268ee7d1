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

pub mod client;
mod contention;
#[doc(hidden)]
pub use contention::force_contended;
/// Test support: the UCX active-message id of a write message (the
/// hostile-member tests forge them).
#[doc(hidden)]
pub use doorbell::WRITE_MESSAGE as WRITE_MESSAGE_ID;
mod control;
#[allow(unsafe_code)]
mod copy;
mod device;
mod doorbell;
pub mod error;
pub mod g3;
mod g3_driver;
pub mod guard;
#[allow(unsafe_code)]
mod lanes;
#[allow(unsafe_code)]
mod memory;
mod peer_driver;
mod placement;
mod shared_memory;
#[allow(unsafe_code)]
mod stream;
#[cfg(test)]
mod tests;
mod warm;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub use kvcr_runner_core::policy;
use kvcr_runner_core::{Action, Core, CoreConfig, G3Config, JobId};
pub use kvcr_runner_core::{
    CachePolicy, ClaimedCopy, CopySpan, CoreCounters, DeliverEntry, DepositEntry, EntryResult,
    EntryStatus, FailReason, G3Counters, KVCR_REGION_PREFIX, MAX_REGION_ELEMENTS, MAX_REGION_LABEL,
    MAX_SPANS_PER_KEY, OpResult, PageInfo, PeerCounters, PeerNotice, PeerStateSizes, PoolConfig,
    PoolId, PoolRange, PoolStats, QueryStatus, RegionDesc, RegionMemory, ReleaseHandle,
    RouteBudget, RunnerStats,
};

pub use self::control::{ControlCounters, ControlLimits};
pub use self::device::DeviceCopier;
pub use self::error::{Error, Result};
pub use self::g3::{G3Error, G3Options, G3Store};
use self::memory::DramPool;
pub use self::peer_driver::{DataStream, GuardOptions, PeerOptions, PutSplit};
pub use self::placement::{
    AnonymousMemory, HugePages, MAX_NUMA_NODE, NumaBinding, NumaMode, PlacementDowngrade,
    PlacementOutcome, PoolMemory, PoolMemoryInfo, online_nodes, shared_memory_huge_pages,
    transparent_huge_page_mode,
};
pub use self::warm::WarmStart;
use crate::error::RunnerReason;
use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::hint::{FetchHint, RequestId};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::key::{Namespace, NamespaceId, ScopedKey};
use kvcr_contracts::protocol::{OpHandle, RegionId};
use kvcr_contracts::tier::{InventorySink, Medium};
pub use kvcr_runner_core::RecoveryReport;
pub use kvcr_runner_core::journal::JournalStats;

/// How long a caller waiting on an operation that awaits a peer's write
/// stays awake (yielding) before it sleeps: about a one-block fetch's round
/// trip on the hosts measured.
const PEER_SPIN: Duration = Duration::from_micros(300);

/// Bytes of KVCR DRAM currently allocated by all runners in this process
/// (a leak check: it returns to its old value after a runner is closed or a
/// startup fails).
pub fn process_pool_bytes() -> u64 {
    memory::live_pool_bytes()
}

/// Runner configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct RunnerConfig {
    /// The pools, in layout order.
    pub pools: Vec<PoolConfig>,
    /// Budget of one operation, measured from its start (default 1 s).
    pub operation_timeout: Duration,
    /// Percent of a pool's slots below which reclaimable space raises
    /// `capacity_needed` (0 disables it, the default).
    pub capacity_low_watermark_percent: u8,
    /// The medium KVCR DRAM is published under (default `CPU_PINNED`).
    pub medium: Medium,
    /// Touch every pool page at startup so the first copies run at full speed.
    pub prefault: bool,
    /// How pools are backed (default: the original allocation; see
    /// [`PoolMemory`] for process-owned anonymous memory with huge pages and
    /// NUMA placement).
    pub pool_memory: PoolMemory,
    /// A file tier under KVCR DRAM (G3): evicted pages move there and are
    /// filled back on demand. Needs exactly one pool, whose block size is the
    /// G3 slot size (a multiple of the files' direct-I/O alignment). The
    /// default policy then moves victims to G3 (`g3-lru`).
    pub g3: Option<G3Options>,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            pools: Vec::new(),
            operation_timeout: Duration::from_secs(1),
            capacity_low_watermark_percent: 0,
            medium: Medium::CpuPinned,
            prefault: true,
            pool_memory: PoolMemory::Default,
            g3: None,
        }
    }
}

/// G3's state: the core's counters and what its I/O reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct G3Stats {
    /// Spills, fills, evictions, bytes, occupancy.
    pub counters: G3Counters,
    /// Transfers the files refused (each failed its spill or fill).
    pub failed_transfers: u64,
    /// The last of those errors (a full disk, a file gone, ...).
    pub last_error: Option<G3Error>,
}

/// Largest single pool (bytes).
pub const MAX_POOL_BYTES: u64 = 1 << 46;

impl RunnerConfig {
    /// A one-pool configuration.
    pub fn single_pool(name: &str, block_size: u64, blocks: u32) -> Self {
        Self {
            pools: vec![PoolConfig {
                name: name.to_owned(),
                block_size,
                blocks,
            }],
            ..Self::default()
        }
    }

    /// Each pool's name, block size and block count, in layout order.
    fn pool_specs(&self) -> Vec<(String, u64, u32)> {
        self.pools
            .iter()
            .map(|p| (p.name.clone(), p.block_size, p.blocks))
            .collect()
    }

    /// The core's configuration: these pools at `pool_bases`, G3 as `g3`
    /// opened it (spilling ahead).
    fn core_config(
        &self,
        pool_bases: Vec<u64>,
        timeout_ns: u64,
        g3: Option<&G3Store>,
    ) -> CoreConfig {
        CoreConfig {
            pools: self.pool_specs(),
            pool_bases,
            operation_timeout_ns: timeout_ns,
            watermark_percent: self.capacity_low_watermark_percent,
            medium: self.medium,
            g3: g3.map(|store| G3Config {
                slots: u32::try_from(store.slots()).unwrap_or(u32::MAX),
                slot_bytes: store.slot_bytes(),
                alignment: store.alignment(),
                spill_ahead: true,
            }),
        }
    }

    /// Checks every bound.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, why| Err(Error::runner(RunnerReason::Config { field, why }));
        if self.pools.is_empty() {
            return bad("pools", "at least one pool is required");
        }
        if self.pools.len() > usize::from(u16::MAX) {
            return bad("pools", "too many pools");
        }
        for (i, pool) in self.pools.iter().enumerate() {
            if pool.block_size == 0 {
                return bad("pools.block_size", "must be at least 1 byte");
            }
            if pool.blocks == 0 || u64::from(pool.blocks) > MAX_REGION_ELEMENTS {
                return bad("pools.blocks", "must be in 1..=2^31");
            }
            if pool
                .block_size
                .checked_mul(u64::from(pool.blocks))
                .is_none_or(|b| b > MAX_POOL_BYTES)
            {
                return bad("pools", "block_size * blocks exceeds 64 TiB");
            }
            let name_ok = !pool.name.is_empty()
                && pool.name.len() <= MAX_REGION_LABEL - KVCR_REGION_PREFIX.len()
                && pool
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !name_ok {
                return bad("pools.name", "must be 1..=54 of [A-Za-z0-9_.-]");
            }
            if self.pools.iter().take(i).any(|p| p.name == pool.name) {
                return Err(Error::runner(RunnerReason::DuplicatePool(
                    kvcr_runner_core::Echo::new(&pool.name),
                )));
            }
        }
        if self.operation_timeout.is_zero() {
            return bad("operation_timeout", "must be positive");
        }
        if self.capacity_low_watermark_percent > 100 {
            return bad("capacity_low_watermark_percent", "must be in 0..=100");
        }
        if self.g3.is_some() && self.pools.len() != 1 {
            return bad(
                "g3",
                "G3 serves exactly one pool (its block size is the slot size)",
            );
        }
        Ok(())
    }
}

/// Startup stages, in order (named in startup errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum StartupStage {
    Validate,
    AllocatePools,
    OpenG3,
    BuildCore,
    StartCopyEngine,
}

impl StartupStage {
    fn name(self) -> &'static str {
        match self {
            Self::Validate => "validate configuration",
            Self::AllocatePools => "allocate pools",
            Self::OpenG3 => "open G3",
            Self::BuildCore => "build core",
            Self::StartCopyEngine => "start copy engine",
        }
    }
}

type CapacityCallback = Box<dyn FnMut(&[(PoolId, u32)]) + Send>;

/// What the caller's threads and the runner's own threads share: the core and
/// everything that must change with it atomically.
struct Inner {
    core: Core,
    sink: Option<Box<dyn InventorySink>>,
    capacity_needed: Option<CapacityCallback>,
    completed: Vec<OpResult>,
    /// Operations nobody will wait for: their results are dropped on
    /// completion ([`Runner::discard_result`]).
    discarded: HashSet<OpHandle>,
    jobs: Sender<copy::Msg>,
    cancels: HashMap<JobId, Arc<[AtomicBool]>>,
    /// Peer actions go to the peer thread (absent when peers are off).
    peer_tx: Option<tokio::sync::mpsc::UnboundedSender<peer_driver::PeerCmd>>,
    /// Runs the copy jobs that touch device regions (absent until set).
    device: Option<Arc<dyn DeviceCopier>>,
    /// Runs G3 transfers (absent without G3, and once the runner stops).
    g3: Option<g3_driver::G3Driver>,
    /// The residency journal, under a guard.
    journal: Option<warm::RunnerJournal>,
}

/// The shared state, plus the clock epoch and a wake-up for waiters.
pub(crate) struct Shared {
    /// This value's own handle, for work that reports back later (G3 jobs).
    me: std::sync::Weak<Shared>,
    inner: Mutex<Inner>,
    completed_cv: Condvar,
    /// Completed operations not yet taken (read without the lock to spin).
    completed_len: AtomicUsize,
    epoch: Instant,
}

impl Shared {
    /// Shares `core`; its clock starts now.
    fn new(
        core: Core,
        jobs: Sender<copy::Msg>,
        peer_tx: Option<tokio::sync::mpsc::UnboundedSender<peer_driver::PeerCmd>>,
        g3: Option<g3_driver::G3Driver>,
        journal: Option<warm::RunnerJournal>,
    ) -> Arc<Self> {
        #[allow(clippy::disallowed_methods)]
        let epoch = Instant::now();
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            inner: Mutex::new(Inner {
                core,
                sink: None,
                capacity_needed: None,
                completed: Vec::new(),
                discarded: HashSet::new(),
                jobs,
                cancels: HashMap::new(),
                peer_tx,
                device: None,
                g3,
                journal,
            }),
            completed_cv: Condvar::new(),
            completed_len: AtomicUsize::new(0),
            epoch,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock can only come from a bug in the core;
        // its state is still structurally valid, so keep serving.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock if it is free now: for peeks a spinning thread may skip
    /// (blocking there would sleep it in the kernel until the holder is done,
    /// and its wake-up cost more than the peek is worth).
    fn try_lock(&self) -> Option<MutexGuard<'_, Inner>> {
        match self.inner.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn now(&self) -> u64 {
        #[allow(clippy::disallowed_methods)]
        let elapsed = self.epoch.elapsed();
        u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Runs `f` on the core under the lock with the current time, then pumps.
    pub(crate) fn with_core_now<T>(&self, f: impl FnOnce(&mut Core, u64) -> T) -> T {
        let now = self.now();
        let mut inner = self.lock();
        let out = f(&mut inner.core, now);
        let completed = self.pump(&mut inner);
        self.notify_unlocked(inner, completed);
        out
    }

    /// Called by the copy thread with a finished job's outcomes.
    pub(crate) fn copy_done(&self, job: JobId, outcomes: &[kvcr_runner_core::CopyOutcome]) {
        let now = self.now();
        let mut inner = self.lock();
        inner.cancels.remove(&job);
        inner.core.handle_copy_done(now, job, outcomes);
        let completed = self.pump(&mut inner);
        self.notify_unlocked(inner, completed);
    }

    /// Releases the lock, then wakes waiters if `completed`: a waiter woken
    /// while the notifier still holds the lock would block on it again, a
    /// second wake-up (each ~100 µs on an idle vCPU of a virtual machine).
    /// No wake-up is lost: a waiter either saw the completion under the lock
    /// or was already waiting when the lock was taken to add it.
    fn notify_unlocked(&self, inner: MutexGuard<'_, Inner>, completed: bool) {
        drop(inner);
        if completed {
            self.completed_cv.notify_all();
        }
    }

    /// Expires due deadlines, then executes what that caused.
    fn expire(&self, inner: &mut Inner) {
        inner.core.handle_timeout(self.now());
        if self.pump(inner) {
            self.completed_cv.notify_all();
        }
    }

    /// A short bounded spin for a completion before sleeping: a single-block
    /// copy finishes in tens of µs, less than a futex wake-up costs here.
    /// While a peer write into us is awaited (a one-block peer fetch takes a
    /// round trip, ~100–200 µs), the spin is longer and yields, so the
    /// threads doing the work keep their CPUs; not at all while the host's
    /// CPUs are contended (see [`contention`]): there a yield gives a whole
    /// time slice away, and a sleeper is woken sooner.
    fn spin_for_completion(&self, start: Instant) {
        let awaiting_peer = self.lock().core.peer_busy().0 > 0;
        let budget = match (awaiting_peer, contention::contended()) {
            (true, true) => return,
            (true, false) => PEER_SPIN,
            (false, _) => copy::SPIN,
        };
        while self.completed_len.load(Ordering::Acquire) == 0 && start.elapsed() < budget {
            if awaiting_peer {
                contention::yield_cpu();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Sleeps until a completion is signalled, the core's next deadline (whose
    /// expiry may complete something), or `remaining` has passed.
    fn sleep_for_progress<'a>(
        &'a self,
        inner: MutexGuard<'a, Inner>,
        remaining: Duration,
    ) -> MutexGuard<'a, Inner> {
        let until_deadline = inner
            .core
            .next_deadline()
            .map(|d| Duration::from_nanos(d.saturating_sub(self.now())));
        let wait = until_deadline.map_or(remaining, |d| d.min(remaining));
        self.completed_cv
            .wait_timeout(inner, wait)
            .map(|(guard, _)| guard)
            .unwrap_or_else(|e| e.into_inner().0)
    }

    /// Executes the core's actions and forwards events and signals; returns
    /// whether completions were added (the caller wakes the waiters).
    #[must_use]
    fn pump(&self, inner: &mut Inner) -> bool {
        let Inner {
            core,
            sink,
            capacity_needed,
            completed,
            discarded,
            jobs,
            cancels,
            peer_tx,
            device,
            g3,
            journal,
        } = inner;
        // Residency changes reach the journal before any action runs: a
        // slot named `Removed` or `Held` is written again only by an action
        // pumped below or later.
        if let Some(journal) = journal {
            journal.append_from(core);
        }
        let mut failed_jobs = Vec::new();
        while let Some(action) = core.poll_action() {
            match action {
                Action::Copy {
                    job,
                    deadline_ns,
                    memory,
                    keys,
                } => {
                    let cancel: Arc<[AtomicBool]> =
                        keys.iter().map(|_| AtomicBool::new(false)).collect();
                    let n = keys.len();
                    let device = match memory {
                        RegionMemory::Host => None,
                        RegionMemory::Device => match device {
                            Some(copier) => Some(Arc::clone(copier)),
                            // Unreachable: device regions need a copier first.
                            None => {
                                failed_jobs.push((job, n));
                                continue;
                            }
                        },
                    };
                    cancels.insert(job, Arc::clone(&cancel));
                    let deadline = self.epoch + Duration::from_nanos(deadline_ns);
                    if jobs
                        .send(copy::Msg::Job(copy::Job {
                            id: job,
                            deadline,
                            keys,
                            cancel,
                            device,
                        }))
                        .is_err()
                    {
                        // The copy thread is gone (it only stops at shutdown):
                        // report the keys cancelled so nothing waits forever.
                        failed_jobs.push((job, n));
                    }
                }
                Action::G3 { job, transfers, .. } => match g3 {
                    // Transfers start at once (a G3 job is planned right
                    // before it is pumped, well inside its deadline); a
                    // cancelled key's transfer runs anyway, into slots the
                    // core keeps until it is reported.
                    Some(driver) => driver.submit(self.me.clone(), job, &transfers),
                    // Stopping: report them cancelled, nothing waits forever.
                    None => failed_jobs.push((job, transfers.len())),
                },
                Action::Send { .. } | Action::Connect { .. } | Action::Put { .. } => {
                    // The peer thread owns the sockets and the UCX worker.
                    if let Some(tx) = peer_tx {
                        let _ = tx.send(peer_driver::PeerCmd::Action(action));
                    }
                }
                Action::Cancel { job, key } => {
                    if let Some(flag) = cancels.get(&job).and_then(|c| c.get(key as usize)) {
                        flag.store(true, Ordering::Release);
                    }
                }
            }
        }
        for (job, n) in failed_jobs {
            cancels.remove(&job);
            core.handle_copy_done(
                self.now(),
                job,
                &vec![kvcr_runner_core::CopyOutcome::Cancelled; n],
            );
        }
        match sink.as_mut() {
            Some(sink) => core.drain_events().for_each(|event| sink.publish(&event)),
            None => core.drain_events().for_each(drop),
        }
        let signals = core.drain_capacity_signals();
        if let (false, Some(callback)) = (signals.is_empty(), capacity_needed.as_mut()) {
            callback(&signals);
        }
        let before = completed.len();
        core.drain_completed(completed);
        if !discarded.is_empty() {
            // Only results drained just now can be discarded ones: an earlier
            // result is removed by `discard_result` itself.
            let fresh = completed.split_off(before);
            completed.extend(fresh.into_iter().filter(|r| !discarded.remove(&r.op)));
        }
        if completed.len() != before {
            self.completed_len.store(completed.len(), Ordering::Release);
            return true;
        }
        false
    }
}

/// The default policy: least recently used, moving victims to G3 when
/// there is one.
fn default_policy(config: &RunnerConfig) -> Box<dyn CachePolicy> {
    if config.g3.is_some() {
        Box::new(policy::G3Lru)
    } else {
        Box::new(policy::Lru)
    }
}

/// Opens the G3 store, its slot the (one) pool's block.
fn open_g3(config: &RunnerConfig) -> Result<Option<G3Store>> {
    let Some(options) = &config.g3 else {
        return Ok(None);
    };
    let slot_bytes = config.pools.first().map_or(0, |p| p.block_size);
    Ok(Some(G3Store::open(options, slot_bytes)?))
}

fn pool_memory_info(
    config: &RunnerConfig,
    ranges: impl Iterator<Item = (u64, u64)>,
    placements: Vec<Option<PlacementOutcome>>,
) -> Vec<PoolMemoryInfo> {
    let ranges: Vec<(u64, u64)> = ranges.collect();
    // One read of `/proc/self/smaps` for every pool (it walks the page
    // tables of every mapping).
    let huge = placement::huge_page_bytes(&ranges);
    config
        .pools
        .iter()
        .zip(ranges)
        .zip(placements)
        .zip(huge)
        .map(
            |(((pool, (base, len)), placement), huge_page_bytes)| PoolMemoryInfo {
                name: pool.name.clone(),
                base,
                len,
                placement,
                huge_page_bytes,
            },
        )
        .collect()
}

/// The rank-local runner.
///
/// Threads: the caller's thread runs the API; a copy thread executes copies
/// and applies their outcomes to the shared core (so operations complete
/// without polling). The sink and the capacity callback run on either thread,
/// under the runner's lock: they must not call back into the runner.
///
/// Drop order is load-bearing: `copy` is declared before `pools`, so dropping a
/// runner stops and joins the copy thread before the pools it copies into and
/// out of are freed.
pub struct Runner {
    copy: copy::CopyEngine,
    /// Owns the registered pool memory in peer mode; stopped after `copy`.
    peer: Option<peer_driver::PeerDriver>,
    shared: Arc<Shared>,
    /// Owns the local-mode pool memory the core addresses; never read, only
    /// freed, and only after the copy thread has stopped.
    #[allow(dead_code)]
    pools: Vec<DramPool>,
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
        let fail = |stage: StartupStage, cause: Error| Error::Startup {
            stage: stage.name(),
            retained: false,
            cause: Box::new(cause),
        };
        let injected = |stage: StartupStage| -> Result<()> {
            if fail_at == Some(stage) {
                Err(fail(
                    stage,
                    Error::runner(RunnerReason::Config {
                        field: "fault injection",
                        why: "injected startup failure",
                    }),
                ))
            } else {
                Ok(())
            }
        };
        injected(StartupStage::Validate)?;
        config
            .validate()
            .map_err(|e| fail(StartupStage::Validate, e))?;

        // Each stage's resources are owned by locals here; returning early drops
        // them in reverse order, which is the release the contract asks for.
        let mut pools = Vec::with_capacity(config.pools.len());
        let mut placements = Vec::with_capacity(config.pools.len());
        for pool in &config.pools {
            let bytes = pool.block_size * u64::from(pool.blocks);
            let (memory, placement) =
                DramPool::allocate_with(bytes, config.prefault, &config.pool_memory)
                    .map_err(|e| fail(StartupStage::AllocatePools, e))?;
            pools.push(memory);
            placements.push(placement);
        }
        injected(StartupStage::AllocatePools)?;
        let g3 = open_g3(&config).map_err(|e| fail(StartupStage::OpenG3, e))?;

        let timeout_ns = u64::try_from(config.operation_timeout.as_nanos()).unwrap_or(u64::MAX);
        let core_config = config.core_config(
            pools.iter().map(DramPool::base).collect(),
            timeout_ns,
            g3.as_ref(),
        );
        let core = Core::new(
            &core_config,
            policy.unwrap_or_else(|| default_policy(&config)),
        )
        .map_err(|e| fail(StartupStage::BuildCore, e.into()))?;
        injected(StartupStage::BuildCore)?;

        let (jobs_tx, jobs_rx) = mpsc::channel::<copy::Msg>();
        let shared = Shared::new(
            core,
            jobs_tx.clone(),
            None,
            g3.map(g3_driver::G3Driver::new),
            None,
        );
        let copy = copy::CopyEngine::start(Arc::downgrade(&shared), jobs_tx, jobs_rx)
            .map_err(|e| fail(StartupStage::StartCopyEngine, e))?;
        let pool_bytes = pools.iter().map(DramPool::len).sum();
        let pool_memory = pool_memory_info(
            &config,
            pools.iter().map(|p| (p.base(), p.len())),
            placements,
        );
        let mut runner = Self {
            copy,
            peer: None,
            shared,
            pools,
            incarnation: Incarnation::generate(),
            endpoint: None,
            worker_address: None,
            pool_bytes,
            pool_memory,
            device: std::sync::OnceLock::new(),
            guard: None,
            warm_start: None,
        };
        if let Err(e) = injected(StartupStage::StartCopyEngine) {
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
        Self::start_peers(config, policy, peer, None)
    }

    /// A guard's backup of an orphaned group: a runner over the group's
    /// pools and listener serving the pages its journal recovered, on the
    /// dead primary's control address, never writing the journal.
    pub(crate) fn start_backup(
        config: RunnerConfig,
        peer: &PeerOptions,
        backup: warm::Claimed,
    ) -> Result<Self> {
        Self::start_peers(config, None, peer, Some(backup))
    }

    fn start_peers(
        config: RunnerConfig,
        policy: Option<Box<dyn CachePolicy>>,
        peer: &PeerOptions,
        backup: Option<warm::Claimed>,
    ) -> Result<Self> {
        let fail = |stage: &'static str, cause: Error| Error::Startup {
            stage,
            retained: false,
            cause: Box::new(cause),
        };
        config
            .validate()
            .map_err(|e| fail(StartupStage::Validate.name(), e))?;
        let pool_bytes: Vec<u64> = config
            .pools
            .iter()
            .map(|p| p.block_size * u64::from(p.blocks))
            .collect();
        let incarnation = Incarnation::generate();
        let pool_specs = config.pool_specs();
        // Under a guard the pools, the journal and the control listener are
        // the guard's (claimed before anything else is made).
        let claimed = match (&peer.guard, backup) {
            (_, Some(backup)) => Some(backup),
            (Some(options), None) => {
                if config.pool_memory != PoolMemory::Default {
                    return Err(fail(
                        StartupStage::Validate.name(),
                        Error::runner(RunnerReason::Config {
                            field: "pool_memory",
                            why: "a guard's pools are its memfds: pool_memory must be the default",
                        }),
                    ));
                }
                Some(
                    warm::claim(options, peer, &pool_specs, incarnation.raw())
                        .map_err(|e| fail("claim guard", e))?,
                )
            }
            (None, None) => None,
        };
        let (claimed, adopted, lease) = match claimed {
            Some(c) => {
                let warm::Claimed {
                    lease,
                    adopted,
                    journal,
                    start,
                } = c;
                (Some((journal, start)), Some(adopted), lease)
            }
            None => (None, None, None),
        };
        // Released if the start fails from here on, so the group can be
        // claimed again (by a retry in this process, say), unless a stage
        // retained resources that may still touch its memory.
        let mut lease = warm::StartingLease::new(lease);
        let (mut driver, setup) = peer_driver::PeerDriver::start(
            peer,
            incarnation,
            pool_bytes.clone(),
            config.prefault,
            &config.pool_memory,
            adopted,
        )
        .map_err(|e| match e {
            // Already a startup error (resources retained): keep it, and
            // the lease with it.
            Error::Startup { retained, .. } => {
                if retained {
                    lease.keep();
                }
                e
            }
            _ => fail("start peer", e),
        })?;
        let g3 = open_g3(&config).map_err(|e| fail(StartupStage::OpenG3.name(), e))?;
        let timeout_ns = u64::try_from(config.operation_timeout.as_nanos()).unwrap_or(u64::MAX);
        let abandon_ns = peer
            .abandon_timeout
            .map_or(timeout_ns.saturating_mul(5), |d| {
                u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
            })
            .max(timeout_ns.saturating_mul(2));
        let core_config = config.core_config(setup.bases.clone(), timeout_ns, g3.as_ref());
        let mut core = Core::new(
            &core_config,
            policy.unwrap_or_else(|| default_policy(&config)),
        )
        .map_err(|e| fail(StartupStage::BuildCore.name(), e.into()))?;
        // Pool i is runner region i (registered first, in order).
        let rkeys = setup
            .rkeys
            .iter()
            .enumerate()
            .map(|(i, rkey)| (RegionId(i as u32), rkey.clone()))
            .collect();
        core.enable_peer(kvcr_runner_core::PeerConfig {
            endpoint: setup.endpoint.clone(),
            incarnation,
            worker_address: setup.worker_address.clone(),
            rkeys,
            abandon_timeout_ns: abandon_ns,
            metadata_retry_ns: 100_000_000,
            allowed_peers: peer.allowed_peers.clone(),
            private_namespaces: peer.private_namespaces.clone(),
            shared_memory: setup.shared_memory.clone(),
            write_batch_bytes: peer.write_batch_bytes,
            route_budget: peer.route_budget,
        });
        let (journal, warm_start) = match claimed {
            Some((journal, mut start)) => {
                // The guard saw these incarnations of this endpoint die: a
                // destination probing a write it sent to one of them is told
                // so, and frees the slots it held for that write.
                core.set_dead_incarnations(
                    start
                        .dead_incarnations
                        .iter()
                        .filter_map(|raw| Incarnation::from_raw(*raw))
                        .collect(),
                );
                let journal = match journal {
                    warm::JournalPlan::Keep(map, recovered) => Some(warm::RunnerJournal::start(
                        &mut core, map, recovered, &mut start,
                    )),
                    warm::JournalPlan::ReadOnly(recovered) => {
                        start.recovery = Some(core.recover(0, &recovered).0);
                        None
                    }
                    warm::JournalPlan::None => None,
                };
                (journal, Some(start))
            }
            None => (None, None),
        };
        let (jobs_tx, jobs_rx) = mpsc::channel::<copy::Msg>();
        let shared = Shared::new(
            core,
            jobs_tx.clone(),
            Some(driver.tx.clone()),
            g3.map(g3_driver::G3Driver::new),
            journal,
        );
        let copy = copy::CopyEngine::start(Arc::downgrade(&shared), jobs_tx, jobs_rx)
            .map_err(|e| fail(StartupStage::StartCopyEngine.name(), e))?;
        driver.attach(Arc::clone(&shared));
        Ok(Self {
            copy,
            peer: Some(driver),
            shared,
            pools: Vec::new(),
            incarnation,
            pool_memory: pool_memory_info(
                &config,
                setup.bases.iter().copied().zip(pool_bytes.iter().copied()),
                setup.placements,
            ),
            worker_address: Some(setup.worker_address.clone()),
            endpoint: Some(setup.endpoint),
            pool_bytes: pool_bytes.iter().sum(),
            device: std::sync::OnceLock::new(),
            guard: lease.started(),
            warm_start,
        })
    }

    /// How this runner started under its guard ([`PeerOptions::guard`]):
    /// warm or fresh, what the recovery seated, or why it was disabled.
    pub fn warm_start(&self) -> Option<&WarmStart> {
        self.warm_start.as_ref()
    }

    /// The residency journal's counters (under a guard, while it runs).
    pub fn journal_stats(&self) -> Option<JournalStats> {
        self.shared
            .lock()
            .journal
            .as_ref()
            .and_then(warm::RunnerJournal::stats)
    }

    /// Where each pool's memory is and how it was placed (for audits such as
    /// `kvcr-hicache-perf`'s, which reads where its pages really are).
    pub fn pool_memory(&self) -> &[PoolMemoryInfo] {
        &self.pool_memory
    }

    /// This runner's advertised control endpoint (peer mode only).
    pub fn endpoint(&self) -> Option<&ControlEndpoint> {
        self.endpoint.as_ref()
    }

    /// Test support: this runner's UCX worker address, which every source
    /// it dials receives in its metadata (the hostile-member tests connect
    /// to it as such a member would). Not for production use.
    #[doc(hidden)]
    pub fn peer_worker_address(&self) -> Option<&[u8]> {
        self.worker_address.as_deref()
    }

    /// Records a request's router hint (and starts the metadata handshake
    /// with its source, off the fetch path).
    pub fn submit_hint(&self, request: RequestId, hint: &FetchHint) {
        self.with_core(|core, now| core.submit_hint(now, request, hint));
    }

    /// Ends a request's hint scope.
    pub fn discard_hint(&self, request: &RequestId) {
        self.with_core(|core, _| core.discard_hint(request));
    }

    /// `fetch` under a request: keys missing here that the request's hint
    /// places on a peer are pulled from it into KVCR DRAM.
    pub fn fetch_hinted(
        &self,
        request: &RequestId,
        keys: &[ScopedKey],
        layout: &[PoolId],
    ) -> Result<OpHandle> {
        self.core_call(|core, now| core.fetch(now, keys, layout, Some(request)))
    }

    /// `deliver` under a request: missing hinted keys are pulled from the peer
    /// first, then copied into the destinations.
    pub fn deliver_hinted(
        &self,
        request: &RequestId,
        entries: Vec<DeliverEntry>,
    ) -> Result<OpHandle> {
        self.core_call(|core, now| core.deliver(now, entries, Some(request)))
    }

    /// `query` under a request: a miss the request's hint covers is `Fetchable`.
    pub fn query_hinted(&self, request: &RequestId, key: &ScopedKey) -> QueryStatus {
        self.shared.lock().core.query_request(key, Some(request))
    }

    /// Notices about memory a peer may still write (uncertain / quiesced).
    pub fn take_notices(&self) -> Vec<PeerNotice> {
        self.shared.lock().core.take_notices()
    }

    /// Peer protocol counters, and the control sockets open now.
    pub fn peer_stats(&self) -> (PeerCounters, usize) {
        let counters = self.shared.lock().core.peer_counters();
        let sockets = self
            .peer
            .as_ref()
            .map_or(0, |p| p.stats.open_sockets.load(Ordering::Relaxed));
        (counters, sockets)
    }

    /// The control channel's counters: what it refused and cut (all zero
    /// without peers).
    pub fn control_stats(&self) -> ControlCounters {
        self.peer
            .as_ref()
            .map_or_else(ControlCounters::default, |p| p.stats.snapshot())
    }

    /// Sizes of the core's per-peer state (routes, fences, hints, ...): what
    /// the trust rules bound.
    pub fn peer_state_sizes(&self) -> PeerStateSizes {
        self.shared.lock().core.peer_state_sizes()
    }

    /// Forgets a peer: closes its control socket and data route.
    pub fn forget_peer(&self, peer: &ControlEndpoint) {
        if let Some(driver) = self.peer.as_ref() {
            let _ = driver.tx.send(peer_driver::PeerCmd::Forget(peer.clone()));
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

    /// Registers a framework region (`label` is `pool` or `pool:part`; its
    /// element size must equal the pool's block size).
    ///
    /// # Safety
    /// `desc.base .. desc.base + extent` must be valid for reads and writes until
    /// the runner is closed or dropped, and the caller must not access an
    /// element named by an operation until that operation has completed.
    #[allow(unsafe_code)]
    pub unsafe fn register_region(&self, desc: RegionDesc) -> Result<RegionId> {
        self.shared
            .lock()
            .core
            .register_region(desc)
            .map_err(Error::from)
    }

    /// Sets the copier that runs every copy job touching device regions and
    /// hands it the pools to pin ([`DeviceCopier::attach`]). Once per runner;
    /// the runner detaches it when dropped, after its copy thread stops and
    /// before its pools are freed.
    pub fn set_device_copier(&self, copier: Arc<dyn DeviceCopier>) -> Result<()> {
        // Under the core's lock, so two callers cannot both attach.
        let mut inner = self.shared.lock();
        if inner.device.is_some() || self.device.get().is_some() {
            return Err(Error::runner(RunnerReason::DeviceCopierSet));
        }
        let pools = inner.core.pool_ranges();
        copier.attach(&pools)?;
        inner.device = Some(Arc::clone(&copier));
        // Cannot be set already: the check above ran under the same lock.
        let _ = self.device.set(copier);
        Ok(())
    }

    /// The runner's pools (host DRAM), as a device copier sees them.
    pub fn pool_ranges(&self) -> Vec<PoolRange> {
        self.shared.lock().core.pool_ranges()
    }

    /// Registers a framework region in device memory (a GPU address in the
    /// process's unified address space). Copies that touch it run on the
    /// device copier, which must be set first; one call of `deposit` or
    /// `deliver` names only host or only device elements.
    ///
    /// # Safety
    /// As [`Runner::register_region`], for device memory: the extent must stay
    /// allocated on the device until the runner is closed or dropped, and the
    /// caller must not touch an element named by an operation until that
    /// operation has completed.
    #[allow(unsafe_code)]
    pub unsafe fn register_device_region(&self, desc: RegionDesc) -> Result<RegionId> {
        if self.device.get().is_none() {
            return Err(Error::runner(RunnerReason::NoDeviceCopier));
        }
        self.shared
            .lock()
            .core
            .register_region_in(desc, RegionMemory::Device)
            .map_err(Error::from)
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
    #[allow(unsafe_code)]
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
        // SAFETY: the element is a slot of a runner-owned pool (bounds-checked
        // by `resolve`); the claim keeps the page READY, READY slots are never
        // written (fills write only FILLING slots), and the lock keeps the claim
        // from being released while we copy; `&self` keeps the pools alive.
        Ok(unsafe { memory::bytes_at(addr, len) }.to_vec())
    }

    /// Expires deadlines and returns completed operations. Never blocks.
    pub fn poll_completed(&self) -> Vec<OpResult> {
        let mut inner = self.shared.lock();
        self.shared.expire(&mut inner);
        self.shared.completed_len.store(0, Ordering::Release);
        std::mem::take(&mut inner.completed)
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
    #[allow(unsafe_code)]
    pub fn copy_claimed(&self, handles: &[ReleaseHandle], copies: &[ClaimedCopy]) -> Result<()> {
        let (spans, pinned) = self.core_call(|core, _| core.pin_claimed_copy(handles, copies))?;
        // SAFETY: the sources are slots of READY records pinned above (an
        // internal claim each, so not evicted or refilled until `unpin`); the
        // destinations are framework host elements bounds-checked by the core
        // against their registrations, which the caller promised valid and
        // untouched while an operation names them (`register_region`); pool
        // and framework regions never overlap (checked at registration).
        unsafe { copy::copy_plan(&spans) };
        self.with_core(|core, _| core.unpin(&pinned));
        Ok(())
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

    /// A snapshot of counts and counters.
    pub fn stats(&self) -> RunnerStats {
        let inner = self.shared.lock();
        let core = &inner.core;
        let (ready, filling, discarding) = core.state_counts();
        RunnerStats {
            policy: core.policy_name(),
            ready,
            filling,
            discarding,
            public_claims: core.public_claims(),
            ops_in_flight: core.ops_in_flight(),
            copies_in_flight: core.jobs_in_flight(),
            pools: core.pool_stats(),
            counters: core.counters(),
        }
    }

    /// What G3 did and holds, and what its I/O reported (`None` without G3).
    pub fn g3_stats(&self) -> Option<G3Stats> {
        let inner = self.shared.lock();
        let counters = inner.core.g3_counters()?;
        let (failed_transfers, last_error) = inner.g3.as_ref().map_or((0, None), |d| {
            let stats = d.stats();
            (
                stats.failed_transfers.load(Ordering::Relaxed),
                stats
                    .last_error
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone(),
            )
        });
        Some(G3Stats {
            counters,
            failed_transfers,
            last_error,
        })
    }

    /// Number of resident (READY, FILLING or DISCARDING) pages.
    pub fn resident_blocks(&self) -> usize {
        self.shared.lock().core.resident_blocks()
    }

    /// Checks the core's structural invariants (for tests and debugging).
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

    /// Total bytes of KVCR DRAM this runner owns.
    pub fn pool_bytes(&self) -> u64 {
        self.pool_bytes
    }
}
