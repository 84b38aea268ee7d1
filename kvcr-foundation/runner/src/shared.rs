//! The state the caller's threads and the runner's own threads (copy, peer,
//! G3 workers) share: the core under one lock, what must change with it
//! atomically, and `pump`, which executes the core's actions after every
//! call and forwards its events, signals and completions. The copy thread,
//! the peer thread and the G3 driver report here, never to `Runner`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kvcr_contracts::protocol::OpHandle;
use kvcr_contracts::tier::InventorySink;
use kvcr_runner_core::{Action, Core, JobId, OpResult, PoolId, RegionMemory};

use kvcr_sys::MemoryRegistry;

use crate::copy::device::DeviceCopier;
use crate::{contention, copy, warm};

/// How long a caller waiting on an operation that awaits a peer's write
/// stays awake (yielding) before it sleeps: about a one-block fetch's round
/// trip on the hosts measured.
const PEER_SPIN: Duration = Duration::from_micros(300);

/// Most first-layer reports kept for [`crate::Runner::poll_leads_landed`]
/// (one per device deliver at most; older ones go first).
const MAX_UNTAKEN_LEADS: usize = 4096;

pub(crate) type CapacityCallback = Box<dyn FnMut(&[(PoolId, u32)]) + Send>;

/// What the caller's threads and the runner's own threads share: the core and
/// everything that must change with it atomically.
pub(crate) struct Inner {
    pub(crate) core: Core,
    pub(crate) sink: Option<Box<dyn InventorySink>>,
    pub(crate) capacity_needed: Option<CapacityCallback>,
    pub(crate) completed: Vec<OpResult>,
    /// Device delivers whose first layer is in place, not yet taken
    /// ([`crate::Runner::poll_leads_landed`]).
    pub(crate) leads_landed: Vec<(OpHandle, u32)>,
    /// Operations nobody will wait for: their results are dropped on
    /// completion ([`crate::Runner::discard_result`]).
    pub(crate) discarded: HashSet<OpHandle>,
    jobs: Sender<copy::Msg>,
    cancels: HashMap<JobId, Arc<[AtomicBool]>>,
    /// Peer actions go to the peer thread (absent when peers are off).
    peer_tx: Option<tokio::sync::mpsc::UnboundedSender<crate::peer::PeerCmd>>,
    /// Runs the copy jobs that touch device regions (absent until set).
    pub(crate) device: Option<Arc<dyn DeviceCopier>>,
    /// Runs G3 transfers (absent without G3, and once the runner stops).
    pub(crate) g3: Option<crate::g3::driver::G3Driver>,
    /// The residency journal, under a guard.
    pub(crate) journal: Option<warm::RunnerJournal>,
}

/// The shared state, plus the clock epoch and a wake-up for waiters.
pub(crate) struct Shared {
    /// This value's own handle, for work that reports back later (G3 jobs).
    me: std::sync::Weak<Shared>,
    inner: Mutex<Inner>,
    completed_cv: Condvar,
    /// The memory copies may touch: the pools and the engine's registered
    /// regions. Every copy the runner makes is checked against it.
    pub(crate) memory: Arc<MemoryRegistry>,
    /// Completed operations not yet taken (read without the lock to spin).
    pub(crate) completed_len: AtomicUsize,
    /// Copy jobs whose lead landed, said from inside a device copier's call
    /// (which holds the copier's locks: this lock is taken alone there,
    /// and only inside the core's elsewhere); the core hears them
    /// ([`Shared::take_copy_leads`]) before the job's outcome.
    copy_leads: Mutex<Vec<JobId>>,
    epoch: Instant,
}

impl Shared {
    /// Shares `core`; its clock starts now.
    pub(crate) fn new(
        core: Core,
        jobs: Sender<copy::Msg>,
        peer_tx: Option<tokio::sync::mpsc::UnboundedSender<crate::peer::PeerCmd>>,
        g3: Option<crate::g3::driver::G3Driver>,
        journal: Option<warm::RunnerJournal>,
        memory: Arc<MemoryRegistry>,
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
                leads_landed: Vec::new(),
                discarded: HashSet::new(),
                jobs,
                cancels: HashMap::new(),
                peer_tx,
                device: None,
                g3,
                journal,
            }),
            completed_cv: Condvar::new(),
            memory,
            completed_len: AtomicUsize::new(0),
            copy_leads: Mutex::new(Vec::new()),
            epoch,
        })
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock can only come from a bug in the core;
        // its state is still structurally valid, so keep serving.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock if it is free now: for peeks a spinning thread may skip
    /// (blocking there would sleep it in the kernel until the holder is done,
    /// and its wake-up cost more than the peek is worth).
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, Inner>> {
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
        self.run_locked(self.lock(), now, f)
    }

    /// [`Self::with_core_now`] if the lock is free now; `None` (and `f` not
    /// run) if another thread holds it. For the peer thread's own
    /// bookkeeping (its nap, its tick), which must not hold up the work a
    /// lock holder hands it: on an H100 host a peer thread sent none of a
    /// restore's `start_write`s until the caller had delivered its last
    /// part, 15 ms of back-to-back deliveries (traced; most likely it lost
    /// the lock, each release retaken before the woken thread ran).
    pub(crate) fn try_with_core_now<T>(&self, f: impl FnOnce(&mut Core, u64) -> T) -> Option<T> {
        let now = self.now();
        Some(self.run_locked(self.try_lock()?, now, f))
    }

    /// Runs `f` on the core held by `inner` at `now`, pumps its actions,
    /// then releases the lock (and wakes waiters if anything completed).
    fn run_locked<T>(
        &self,
        mut inner: MutexGuard<'_, Inner>,
        now: u64,
        f: impl FnOnce(&mut Core, u64) -> T,
    ) -> T {
        let out = f(&mut inner.core, now);
        let completed = self.pump(&mut inner);
        self.notify_unlocked(inner, completed);
        out
    }

    /// Called from inside a device copier's call: copy job `job`'s lead
    /// spans have landed.
    pub(crate) fn copy_lead_landed(&self, job: JobId) {
        self.copy_leads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(job);
    }

    /// Hands the copy jobs whose lead landed to the core (under its lock);
    /// the reports that makes reach the runner's list when the core is
    /// next pumped or polled (`Runner::poll_leads_landed`).
    pub(crate) fn take_copy_leads(&self, inner: &mut Inner) {
        let jobs = std::mem::take(
            &mut *self
                .copy_leads
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for job in jobs {
            inner.core.handle_copy_lead_landed(job);
        }
    }

    /// Called by the copy thread with a finished job's outcomes.
    pub(crate) fn copy_done(&self, job: JobId, outcomes: &[kvcr_runner_core::CopyOutcome]) {
        self.copy_done_digested(job, outcomes, &[]);
    }

    /// As [`Shared::copy_done`], with the page digest taken of each key.
    pub(crate) fn copy_done_digested(
        &self,
        job: JobId,
        outcomes: &[kvcr_runner_core::CopyOutcome],
        digests: &[Option<u64>],
    ) {
        let now = self.now();
        let mut inner = self.lock();
        inner.cancels.remove(&job);
        // A lead said during the copy is heard before the job ends.
        self.take_copy_leads(&mut inner);
        inner
            .core
            .handle_copy_done_digested(now, job, outcomes, digests);
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
    pub(crate) fn expire(&self, inner: &mut Inner) {
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
    /// CPUs are contended (see [`crate::contention`]): there a yield gives a whole
    /// time slice away, and a sleeper is woken sooner.
    pub(crate) fn spin_for_completion(&self, start: Instant) {
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
    pub(crate) fn sleep_for_progress<'a>(
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
            leads_landed,
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
                    digest,
                    lead,
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
                            digest,
                            lead: usize::from(lead),
                        }))
                        .is_err()
                    {
                        // The copy thread is gone (it only stops at shutdown):
                        // report the keys cancelled so nothing waits forever.
                        failed_jobs.push((job, n));
                    }
                }
                Action::G3 {
                    job,
                    transfers,
                    digests,
                    ..
                } => match g3 {
                    // Transfers start at once (a G3 job is planned right
                    // before it is pumped, well inside its deadline); a
                    // cancelled key's transfer runs anyway, into slots the
                    // core keeps until it is reported.
                    Some(driver) => driver.submit(self.me.clone(), job, &transfers, digests),
                    // Stopping: report them cancelled, nothing waits forever.
                    None => failed_jobs.push((job, transfers.len())),
                },
                Action::Send { .. } | Action::Connect { .. } | Action::Put { .. } => {
                    // The peer thread owns the sockets and the UCX worker.
                    if let Some(tx) = peer_tx {
                        let _ = tx.send(crate::peer::PeerCmd::Action(action));
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
        leads_landed.extend(core.drain_leads_landed());
        // Progress nobody took: the newest are kept, so a caller that
        // never polls for them does not grow this without bound.
        let excess = leads_landed.len().saturating_sub(MAX_UNTAKEN_LEADS);
        leads_landed.drain(..excess);
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
