//! [`Pools`]: where KVCR keeps pages. The DRAM pools (their ranges, bytes
//! and placement, how many pages they hold), the device copier that pins
//! them for GPU copies, and the G3 file tier they spill to.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use kvcr_runner_core::PoolRange;

use crate::PoolMemoryInfo;
use crate::copy::device::DeviceCopier;
use crate::error::RunnerReason;
use crate::stats::G3Stats;
use crate::{Error, Result, Runner};

/// The runner's memory, from [`Runner::pools`].
///
/// ```ignore
/// let gib = runner.pools().bytes() as f64 / f64::from(1 << 30);
/// ```
#[derive(Clone, Copy)]
pub struct Pools<'a> {
    runner: &'a Runner,
}

impl<'a> Pools<'a> {
    pub(crate) fn new(runner: &'a Runner) -> Self {
        Self { runner }
    }

    /// Total bytes of KVCR DRAM this runner owns.
    pub fn bytes(&self) -> u64 {
        self.runner.pool_bytes
    }

    /// The runner's pools (host DRAM), as a device copier sees them.
    pub fn ranges(&self) -> Vec<PoolRange> {
        self.runner.shared.lock().core.pool_ranges()
    }

    /// Where each pool's memory is and how it was placed (for audits such as
    /// `kvcr-hicache-perf`'s, which reads where its pages really are).
    pub fn memory(&self) -> &'a [PoolMemoryInfo] {
        &self.runner.pool_memory
    }

    /// Number of resident (READY, FILLING or DISCARDING) pages.
    pub fn resident_blocks(&self) -> usize {
        self.runner.shared.lock().core.resident_blocks()
    }

    /// Sets the copier that runs every copy job touching device regions and
    /// hands it the pools to pin ([`DeviceCopier::attach`]). Once per runner;
    /// the runner detaches it when dropped, after its copy thread stops and
    /// before its pools are freed. Set it before
    /// [`Runner::register_device_region`].
    pub fn set_device_copier(&self, copier: Arc<dyn DeviceCopier>) -> Result<()> {
        // Under the core's lock, so two callers cannot both attach.
        let mut inner = self.runner.shared.lock();
        if inner.device.is_some() || self.runner.device.get().is_some() {
            return Err(Error::runner(RunnerReason::DeviceCopierSet));
        }
        let pools = inner.core.pool_ranges();
        copier.attach(&pools)?;
        inner.device = Some(Arc::clone(&copier));
        // Cannot be set already: the check above ran under the same lock.
        let _ = self.runner.device.set(copier);
        Ok(())
    }

    /// What G3 did and holds, and what its I/O reported (`None` without G3).
    pub fn g3_stats(&self) -> Option<G3Stats> {
        let inner = self.runner.shared.lock();
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
}

impl std::fmt::Debug for Pools<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pools").finish_non_exhaustive()
    }
}
