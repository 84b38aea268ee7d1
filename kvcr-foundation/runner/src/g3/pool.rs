//! The store's worker threads: they run the items of submitted batches, many
//! at once, so a large spill or fill keeps several requests in flight on
//! every file.
//!
//! A batch is a list of [`G3Io`] items plus the function that executes one
//! (built by `direct_io`, which checks each item's memory against the
//! store's registry). Items are claimed one at a time from the oldest batch
//! (an atomic cursor), so consecutive slots (which sit in consecutive files)
//! go to different threads; each item's outcome lands in its own cell and the
//! last item to finish completes the batch: it wakes the submitter that waits
//! ([`WorkerPool::run`], which also executes items itself while any are
//! unclaimed) or calls the submitter's callback ([`WorkerPool::submit`]).
//!
//! Drop: stop is raised, every worker first drains the queue (every submitted
//! item runs and every callback is called: a submitter's memory is promised
//! only until then), then the threads are joined.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;

use super::{G3Error, G3Io};

/// One item's outcome.
pub(super) type Outcome = Result<(), G3Error>;

/// Executes one item (see `direct_io`).
pub(super) type Exec = Arc<dyn Fn(&G3Io) -> Outcome + Send + Sync>;

/// Called once with every item's outcome, in item order.
pub(super) type Done = Box<dyn FnOnce(Vec<Outcome>) + Send>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks (a callback runs unlocked and
    // under `catch_unwind`); recover the guard anyway.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How a batch tells its submitter it is over.
enum Finish {
    /// A thread waits in [`WorkerPool::run`].
    Wait { over: Mutex<bool>, cv: Condvar },
    /// A callback (taken once).
    Call(Mutex<Option<Done>>),
}

struct Batch {
    items: Vec<G3Io>,
    exec: Exec,
    /// The next unclaimed item (may run past `items.len()`).
    next: AtomicUsize,
    /// Items not yet finished.
    remaining: AtomicUsize,
    results: Box<[OnceLock<Outcome>]>,
    finish: Finish,
}

impl Batch {
    fn new(items: Vec<G3Io>, exec: Exec, finish: Finish) -> Self {
        let results = (0..items.len()).map(|_| OnceLock::new()).collect();
        Self {
            remaining: AtomicUsize::new(items.len()),
            items,
            exec,
            next: AtomicUsize::new(0),
            results,
            finish,
        }
    }

    fn exhausted(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.items.len()
    }

    /// Claims and runs items until none is left unclaimed; the call that
    /// finishes the last item completes the batch.
    fn work(&self, panics: &AtomicU64) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = self.items.get(i) else {
                return;
            };
            // The executor does not panic; if it ever did, the item fails
            // instead of leaving its batch (and its waiter) unfinished.
            let outcome = catch_unwind(AssertUnwindSafe(|| (self.exec)(item))).unwrap_or(Err(
                G3Error::Internal {
                    why: "an item's execution panicked",
                },
            ));
            if let Some(cell) = self.results.get(i) {
                // Each index is claimed once, so the cell is empty.
                let _ = cell.set(outcome);
            }
            if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.complete(panics);
            }
        }
    }

    /// Every item's outcome, in order (called once all are set).
    fn outcomes(&self) -> Vec<Outcome> {
        self.results
            .iter()
            .map(|cell| {
                cell.get().cloned().unwrap_or(Err(G3Error::Internal {
                    why: "an item finished without an outcome",
                }))
            })
            .collect()
    }

    fn complete(&self, panics: &AtomicU64) {
        match &self.finish {
            Finish::Wait { over, cv } => {
                *lock(over) = true;
                cv.notify_all();
            }
            Finish::Call(done) => {
                let done = lock(done).take();
                if let Some(done) = done {
                    let outcomes = self.outcomes();
                    // A panicking callback must not take the worker (and the
                    // batches queued behind it) down with it.
                    if catch_unwind(AssertUnwindSafe(|| done(outcomes))).is_err() {
                        panics.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    }
}

/// Waits (also while unwinding) until every item of a waited batch finished,
/// so no worker can touch the submitter's memory after `run` returns.
struct WaitGuard<'a>(&'a Batch);

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if let Finish::Wait { over, cv } = &self.0.finish {
            let mut done = lock(over);
            while !*done {
                done = cv.wait(done).unwrap_or_else(PoisonError::into_inner);
            }
        }
    }
}

struct Queue {
    batches: VecDeque<Arc<Batch>>,
    stop: bool,
}

struct PoolShared {
    queue: Mutex<Queue>,
    cv: Condvar,
    /// Callbacks that panicked (caught).
    callback_panics: AtomicU64,
}

/// The store's worker threads.
pub(super) struct WorkerPool {
    shared: Arc<PoolShared>,
    threads: Vec<JoinHandle<()>>,
}

impl WorkerPool {
    /// Starts `threads` (at least one) workers named `kvcr-g3-<i>`.
    pub(super) fn start(threads: usize) -> Result<Self, G3Error> {
        let shared = Arc::new(PoolShared {
            queue: Mutex::new(Queue {
                batches: VecDeque::new(),
                stop: false,
            }),
            cv: Condvar::new(),
            callback_panics: AtomicU64::new(0),
        });
        // Threads started before a failure are stopped by this pool's drop.
        let mut pool = Self {
            shared,
            threads: Vec::with_capacity(threads),
        };
        for i in 0..threads.max(1) {
            let shared = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("kvcr-g3-{i}"))
                .spawn(move || worker(&shared))
                .map_err(|e| G3Error::Start {
                    errno: e.raw_os_error(),
                })?;
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    /// Number of worker threads.
    pub(super) fn threads(&self) -> usize {
        self.threads.len()
    }

    /// Callbacks that panicked so far (each was caught; its batch was over).
    pub(super) fn callback_panics(&self) -> u64 {
        self.shared.callback_panics.load(Ordering::Relaxed)
    }

    /// Runs every item and returns their outcomes in order. The calling
    /// thread executes items too; a batch of one runs on it alone (no
    /// hand-off). Returns only once every item has finished.
    pub(super) fn run(&self, items: Vec<G3Io>, exec: Exec) -> Vec<Outcome> {
        if items.len() <= 1 {
            return items.iter().map(|item| exec(item)).collect();
        }
        let helpers = (items.len() - 1).min(self.threads.len());
        let batch = Arc::new(Batch::new(
            items,
            exec,
            Finish::Wait {
                over: Mutex::new(false),
                cv: Condvar::new(),
            },
        ));
        self.enqueue(Arc::clone(&batch), helpers);
        {
            let guard = WaitGuard(&batch);
            batch.work(&self.shared.callback_panics);
            drop(guard);
        }
        batch.outcomes()
    }

    /// Queues the items and returns at once; `done` is called with their
    /// outcomes, in order, on the worker that finishes the last item (on
    /// this thread, now, for an empty batch).
    pub(super) fn submit(&self, items: Vec<G3Io>, exec: Exec, done: Done) {
        if items.is_empty() {
            done(Vec::new());
            return;
        }
        let helpers = items.len().min(self.threads.len());
        let batch = Arc::new(Batch::new(
            items,
            exec,
            Finish::Call(Mutex::new(Some(done))),
        ));
        self.enqueue(batch, helpers);
    }

    fn enqueue(&self, batch: Arc<Batch>, helpers: usize) {
        lock(&self.shared.queue).batches.push_back(batch);
        if helpers >= self.threads.len() {
            self.shared.cv.notify_all();
        } else {
            for _ in 0..helpers {
                self.shared.cv.notify_one();
            }
        }
    }
}

fn worker(shared: &PoolShared) {
    loop {
        let batch = {
            let mut queue = lock(&shared.queue);
            loop {
                match queue.batches.front() {
                    Some(front) if front.exhausted() => {
                        queue.batches.pop_front();
                    }
                    Some(front) => break Arc::clone(front),
                    None if queue.stop => return,
                    None => {
                        queue = shared
                            .cv
                            .wait(queue)
                            .unwrap_or_else(PoisonError::into_inner);
                    }
                }
            }
        };
        batch.work(&shared.callback_panics);
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        lock(&self.shared.queue).stop = true;
        self.shared.cv.notify_all();
        let me = std::thread::current().id();
        for handle in self.threads.drain(..) {
            // A callback that owned the store's last handle drops it on a
            // worker: that worker cannot join itself; it exits on its own
            // once the queue is drained.
            if handle.thread().id() != me {
                let _ = handle.join();
            }
        }
    }
}
