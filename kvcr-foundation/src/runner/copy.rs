//! The local copy engine: one thread that executes copy jobs off the caller's
//! thread and posts completions back.
//!
//! The thread blocks on its queue when idle (no busy loop, no sleep floor), so
//! a single-block copy costs one thread wake-up plus the memcpy.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::core::{CopyOutcome, JobId};

/// How long a thread that just finished work polls for more before it blocks.
/// A blocked thread costs a futex wake-up (tens of µs on a VM) to restart; a
/// short bounded poll lets back-to-back single-block operations skip it, and
/// an idle engine still sleeps after this long.
const SPIN: Duration = Duration::from_micros(50);
use super::memory::{CopySpan, copy_spans};
use crate::error::{Error, Result, RunnerReason};

struct Job {
    id: JobId,
    deadline: Instant,
    keys: Vec<Vec<CopySpan>>,
    cancel: Arc<[AtomicBool]>,
}

/// A finished job.
pub(crate) struct Done {
    pub(crate) job: JobId,
    pub(crate) outcomes: Vec<CopyOutcome>,
}

/// Handle to the copy thread. Dropping it cancels queued work, lets the key in
/// progress finish, and joins the thread: after drop, no copy touches memory.
pub(crate) struct CopyEngine {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    cancels: HashMap<JobId, Arc<[AtomicBool]>>,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl CopyEngine {
    pub(crate) fn start() -> Result<Self> {
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let shutdown = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&shutdown);
        let thread = std::thread::Builder::new()
            .name("kvcr-copy".into())
            .spawn(move || worker(&jobs_rx, &done_tx, &stop))
            .map_err(|_| Error::runner(RunnerReason::CopyEngineStopped))?;
        Ok(Self {
            jobs: Some(jobs_tx),
            done: done_rx,
            cancels: HashMap::new(),
            shutdown,
            thread: Some(thread),
        })
    }

    pub(crate) fn submit(
        &mut self,
        id: JobId,
        deadline: Instant,
        keys: Vec<Vec<CopySpan>>,
    ) -> Result<()> {
        let cancel: Arc<[AtomicBool]> = keys.iter().map(|_| AtomicBool::new(false)).collect();
        self.cancels.insert(id, Arc::clone(&cancel));
        let sender = self
            .jobs
            .as_ref()
            .ok_or(Error::runner(RunnerReason::CopyEngineStopped))?;
        sender
            .send(Job {
                id,
                deadline,
                keys,
                cancel,
            })
            .map_err(|_| Error::runner(RunnerReason::CopyEngineStopped))
    }

    pub(crate) fn cancel(&self, id: JobId, key: u32) {
        if let Some(flag) = self.cancels.get(&id).and_then(|c| c.get(key as usize)) {
            flag.store(true, Ordering::Release);
        }
    }

    /// Finished jobs, without blocking.
    pub(crate) fn try_done(&mut self) -> Vec<Done> {
        let mut out = Vec::new();
        while let Ok(done) = self.done.try_recv() {
            self.cancels.remove(&done.job);
            out.push(done);
        }
        out
    }

    /// Waits up to `timeout` for at least one finished job.
    pub(crate) fn wait_done(&mut self, timeout: Duration) -> Vec<Done> {
        if let Some(first) = spin_recv(&self.done, SPIN.min(timeout)) {
            self.cancels.remove(&first.job);
            let mut out = vec![first];
            out.extend(self.try_done());
            return out;
        }
        match self.done.recv_timeout(timeout.saturating_sub(SPIN)) {
            Ok(first) => {
                self.cancels.remove(&first.job);
                let mut out = vec![first];
                out.extend(self.try_done());
                out
            }
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => Vec::new(),
        }
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::Release);
        // Closing the queue ends the worker's loop once it has drained (and,
        // because of the shutdown flag, skipped) what is queued.
        self.jobs = None;
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            // The worker only copies validated spans; a panic there is a bug.
            // Joining still guarantees it no longer touches memory.
            eprintln!("kvcr: copy thread panicked");
        }
    }
}

/// Polls `rx` for up to `budget` (bounded; never an idle busy loop).
fn spin_recv<T>(rx: &Receiver<T>, budget: Duration) -> Option<T> {
    #[allow(clippy::disallowed_methods)]
    let start = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(item) => return Some(item),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if start.elapsed() >= budget {
            return None;
        }
        std::hint::spin_loop();
    }
}

fn worker(jobs: &Receiver<Job>, done: &Sender<Done>, shutdown: &AtomicBool) {
    loop {
        let Some(job) = spin_recv(jobs, SPIN).or_else(|| jobs.recv().ok()) else {
            return;
        };
        let mut outcomes = Vec::with_capacity(job.keys.len());
        for (i, spans) in job.keys.iter().enumerate() {
            let cancelled = shutdown.load(Ordering::Acquire)
                || job.cancel.get(i).is_some_and(|c| c.load(Ordering::Acquire));
            if cancelled {
                outcomes.push(CopyOutcome::Cancelled);
                continue;
            }
            // The driver reads the clock; the core never does.
            #[allow(clippy::disallowed_methods)]
            let late = Instant::now() > job.deadline;
            if late {
                outcomes.push(CopyOutcome::DeadlinePassed);
                continue;
            }
            // SAFETY: every span was produced by the core from registrations it
            // bounds-checked: sources and destinations lie inside either a
            // runner-owned pool (alive until this thread is joined, see
            // `Runner`'s field order) or a framework region the caller promised
            // valid for the runner's lifetime (`Runner::register_region`'s
            // contract). A FILLING slot is written only by its own fill, a
            // READY slot is only read while claimed, and the caller promised not
            // to touch framework elements of an operation until it completes;
            // pool and framework regions never overlap (checked at registration).
            unsafe { copy_spans(spans) };
            outcomes.push(CopyOutcome::Copied);
        }
        if done
            .send(Done {
                job: job.id,
                outcomes,
            })
            .is_err()
        {
            return;
        }
    }
}
