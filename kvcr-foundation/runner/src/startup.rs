//! The runner's three start-up paths: local ([`Runner::start`]), with peers
//! ([`Runner::start_with_peers`]) and a guard's backup of an orphaned group.
//! Each is all or nothing: a failing stage releases what earlier stages
//! took, and the error names the stage. They hand `Runner` its parts.
//!
//! [`Runner::start`]: crate::Runner::start
//! [`Runner::start_with_peers`]: crate::Runner::start_with_peers

use std::sync::Arc;
use std::sync::mpsc;

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::RegionId;
use kvcr_runner_core::{CachePolicy, Core, policy};
use kvcr_sys::mapping::DramPool;
use kvcr_sys::placement::{self, PlacementOutcome, PoolMemory, PoolMemoryInfo};
use kvcr_sys::{MemoryRegistry, RegisteredMemory};

use crate::config::{PeerOptions, RunnerConfig};
use crate::copy;
use crate::error::{Error, Result, RunnerReason};
use crate::g3::G3Store;
use crate::g3::driver::G3Driver;
use crate::guard::GuardLease;
use crate::peer::PeerDriver;
use crate::shared::Shared;
use crate::warm::{self, WarmStart};

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
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Validate => "validate configuration",
            Self::AllocatePools => "allocate pools",
            Self::OpenG3 => "open G3",
            Self::BuildCore => "build core",
            Self::StartCopyEngine => "start copy engine",
        }
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

/// A started runner's parts, as [`Runner`](crate::Runner) holds them (the
/// device copier is set later).
pub(crate) struct Started {
    pub(crate) copy: copy::CopyEngine,
    pub(crate) peer: Option<PeerDriver>,
    pub(crate) shared: Arc<Shared>,
    /// The local pools, registered for copies (freed when dropped).
    pub(crate) pools: Vec<RegisteredMemory>,
    pub(crate) incarnation: Incarnation,
    pub(crate) endpoint: Option<ControlEndpoint>,
    pub(crate) worker_address: Option<Vec<u8>>,
    pub(crate) pool_bytes: u64,
    pub(crate) pool_memory: Vec<PoolMemoryInfo>,
    pub(crate) guard: Option<GuardLease>,
    pub(crate) warm_start: Option<WarmStart>,
}

/// A startup error: `cause`, at `stage`, nothing retained.
fn failed(stage: StartupStage, cause: Error) -> Error {
    Error::Startup {
        stage: stage.name(),
        retained: false,
        cause: Box::new(cause),
    }
}

/// The failure injected after `stage` when `fail_at` names it (tests).
pub(crate) fn injected(fail_at: Option<StartupStage>, stage: StartupStage) -> Result<()> {
    if fail_at == Some(stage) {
        Err(failed(
            stage,
            Error::runner(RunnerReason::Config {
                field: "fault injection",
                why: "injected startup failure",
            }),
        ))
    } else {
        Ok(())
    }
}

/// The local path ([`Runner::start`](crate::Runner::start)): validates,
/// allocates (and pre-faults) the pools, opens G3, builds the core and
/// starts the copy thread. Each stage's resources are owned by locals here;
/// returning early drops them in reverse order, which is the release the
/// contract asks for. `fail_at` injects a failure after that stage (tests);
/// the last stage's is the caller's, once the runner is whole.
pub(crate) fn local(
    config: RunnerConfig,
    policy: Option<Box<dyn CachePolicy>>,
    fail_at: Option<StartupStage>,
) -> Result<Started> {
    injected(fail_at, StartupStage::Validate)?;
    config
        .validate()
        .map_err(|e| failed(StartupStage::Validate, e))?;

    // Every copy goes through the registry: the pools are held in it until
    // the runner drops them (after its copy thread has stopped).
    let memory = Arc::new(MemoryRegistry::new());
    let mut pools = Vec::with_capacity(config.pools.len());
    let mut placements = Vec::with_capacity(config.pools.len());
    for pool in &config.pools {
        let bytes = pool.block_size * u64::from(pool.blocks);
        let (pool, placement) =
            DramPool::allocate_with(bytes, config.prefault, &config.pool_memory)
                .map_err(|e| failed(StartupStage::AllocatePools, e.into()))?;
        let pool = memory
            .hold(Arc::new(pool))
            .map_err(|e| failed(StartupStage::AllocatePools, e.into()))?;
        pools.push(pool);
        placements.push(placement);
    }
    injected(fail_at, StartupStage::AllocatePools)?;
    let g3 = open_g3(&config).map_err(|e| failed(StartupStage::OpenG3, e))?;

    let timeout_ns = u64::try_from(config.operation_timeout.as_nanos()).unwrap_or(u64::MAX);
    let core_config = config.core_config(
        pools.iter().map(RegisteredMemory::base).collect(),
        timeout_ns,
        g3.as_ref(),
    );
    let core = Core::new(
        &core_config,
        policy.unwrap_or_else(|| default_policy(&config)),
    )
    .map_err(|e| failed(StartupStage::BuildCore, e.into()))?;
    injected(fail_at, StartupStage::BuildCore)?;

    let (jobs_tx, jobs_rx) = mpsc::channel::<copy::Msg>();
    let g3 = g3.map(|store| G3Driver::new(store, Arc::clone(&memory)));
    let shared = Shared::new(core, jobs_tx.clone(), None, g3, None, Arc::clone(&memory));
    let copy = copy::CopyEngine::start(Arc::downgrade(&shared), memory, jobs_tx, jobs_rx)
        .map_err(|e| failed(StartupStage::StartCopyEngine, e))?;
    let pool_bytes = pools.iter().map(RegisteredMemory::len).sum();
    let pool_memory = pool_memory_info(
        &config,
        pools.iter().map(|p| (p.base(), p.len())),
        placements,
    );
    Ok(Started {
        copy,
        peer: None,
        shared,
        pools,
        incarnation: Incarnation::generate(),
        endpoint: None,
        worker_address: None,
        pool_bytes,
        pool_memory,
        guard: None,
        warm_start: None,
    })
}

/// The peer paths ([`Runner::start_with_peers`](crate::Runner::start_with_peers),
/// and a guard's backup, `backup`): the peer thread allocates and registers
/// the pools (or maps the guard's), binds the control channel and creates
/// the UCX worker; then G3, the core with peers enabled, the journal under
/// a guard, and the copy thread.
pub(crate) fn with_peers(
    config: RunnerConfig,
    policy: Option<Box<dyn CachePolicy>>,
    peer: &PeerOptions,
    backup: Option<warm::Claimed>,
) -> Result<Started> {
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
    // Every copy goes through the registry: the peer thread holds its pools
    // in it (and in UCX) until it drops them.
    let memory = Arc::new(MemoryRegistry::new());
    let (mut driver, setup) = PeerDriver::start(
        peer,
        incarnation,
        pool_bytes.clone(),
        config.prefault,
        &config.pool_memory,
        adopted,
        Arc::clone(&memory),
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
        one_hop_write_batch_bytes: peer.one_hop_write_batch_bytes,
        route_budget: peer.route_budget,
        route_budget_total: peer.route_budget_total,
        one_hop: peer.one_hop,
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
        g3.map(|store| G3Driver::new(store, Arc::clone(&memory))),
        journal,
        Arc::clone(&memory),
    );
    let copy = copy::CopyEngine::start(Arc::downgrade(&shared), memory, jobs_tx, jobs_rx)
        .map_err(|e| fail(StartupStage::StartCopyEngine.name(), e))?;
    driver.attach(Arc::clone(&shared));
    Ok(Started {
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
        guard: lease.started(),
        warm_start,
    })
}
