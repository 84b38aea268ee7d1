//! The UCP worker: progress, the event fd, waiting, connecting, flushing.

use std::cell::Cell;
use std::os::fd::{BorrowedFd, RawFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use super::context::{Context, ContextInner, new_id};
use super::endpoint::{Endpoint, EndpointInner, RkeyInner};
use super::memory::{AnonOptions, RegCore};
use super::message::Messages;
use super::packed::Limits;
use super::request::{Completion, OpKind, OpState, submit};
use super::wire::WorkerAddress;
use super::{UcxReason, result, sys};
use crate::error::{Error, Result};

/// A reference an operation released inside a UCX callback, dropped by the
/// worker after `ucp_worker_progress` returns (dropping it may destroy an
/// rkey, close an endpoint or unmap memory, none of which is allowed inside
/// a callback).
pub(crate) enum Deferred {
    Rkey(#[allow(dead_code)] Rc<RkeyInner>),
    Endpoint(#[allow(dead_code)] Rc<EndpointInner>),
    Registration(#[allow(dead_code)] Rc<RegCore>),
}

/// Shared state of a worker. Endpoints and in-flight operations hold an `Rc`
/// to it, so `ucp_worker_destroy` runs only after every endpoint is closed
/// and every operation has completed.
///
/// Field order is load-bearing: `Drop::drop` releases the UCX buffers of
/// received messages nobody took, then destroys `handle`; then `deferred`
/// (empty by then), `messages` (whose handlers are the receive callbacks'
/// arguments, so they go only after the worker) and finally `ctx` are
/// dropped, so the context is cleaned up after the worker.
pub(crate) struct WorkerInner {
    pub(crate) handle: sys::ucp_worker_h,
    pub(crate) id: u64,
    /// What peers' packed addresses and rkeys are checked against (from
    /// this worker's own address and a probe registration's rkey).
    pub(crate) limits: Limits,
    efd: Option<RawFd>,
    /// The largest active-message header UCX can send from this worker
    /// (`max_am_header`: what fits a first fragment on every interface).
    /// UCX 1.13 does not check it: a longer header overruns the fragment
    /// buffer inside `ucp_am_send_nbx` (a segfault over posix at 9000 bytes).
    pub(crate) max_am_header: usize,
    /// Sequence number of the last put issued on this worker.
    pub(crate) op_seq: Cell<u64>,
    /// Every put up to this sequence number is remotely complete (a worker
    /// flush issued after it completed).
    pub(crate) flushed_through: Cell<u64>,
    deferred: Cell<Vec<Deferred>>,
    /// Active messages: the inbox and the accepted ids.
    pub(crate) messages: Messages,
    pub(crate) ctx: Rc<ContextInner>,
}

impl WorkerInner {
    /// One `ucp_worker_progress` call, then releases what callbacks deferred.
    pub(crate) fn progress(&self) -> u32 {
        // SAFETY: `handle` is a live worker (destroyed only in `Drop`, which
        // cannot run while `&self` exists); this thread is the only one that
        // ever touches it (`WorkerInner` is reachable only through `!Send`
        // handles), as `UCS_THREAD_MODE_SINGLE` requires.
        let n = unsafe { result::worker::progress(self.handle) };
        self.drain();
        n
    }

    pub(crate) fn defer(&self, d: Deferred) {
        let mut list = self.deferred.take();
        list.push(d);
        self.deferred.set(list);
    }

    /// Drops deferred references, oldest first (an rkey before the endpoint it
    /// was unpacked on). Their drops may progress this worker again; the list
    /// is moved out first, so that is fine.
    fn drain(&self) {
        loop {
            let list = self.deferred.take();
            if list.is_empty() {
                return;
            }
            drop(list);
        }
    }

    /// This worker's packed UCX address (`ucp_worker_get_address`).
    fn packed_address(&self) -> Result<Vec<u8>> {
        // SAFETY: live worker on its thread.
        let (addr, len) = unsafe { result::worker::get_address(self.handle) }?;
        let bytes = if addr.is_null() || len == 0 {
            Vec::new()
        } else {
            // SAFETY: on success UCX returned `addr` pointing at `len`
            // initialised bytes, valid until released below.
            unsafe { std::slice::from_raw_parts(addr.cast_const().cast::<u8>(), len) }.to_vec()
        };
        if !addr.is_null() {
            // SAFETY: `addr` came from `ucp_worker_get_address` on this
            // worker and is released once; `bytes` is an owned copy.
            unsafe { result::worker::release_address(self.handle, addr) };
        }
        Ok(bytes)
    }

    pub(crate) fn next_seq(&self) -> u64 {
        let s = self.op_seq.get().saturating_add(1);
        self.op_seq.set(s);
        s
    }

    /// `ucp_worker_arm`: `Ok(true)` when armed (safe to sleep on the fd),
    /// `Ok(false)` when events are pending (progress again first).
    fn arm(&self) -> Result<bool> {
        // SAFETY: live worker, owning thread (see `progress`); the context
        // was created with `UCP_FEATURE_WAKEUP` (checked by the callers via
        // `efd.is_some()`).
        unsafe { result::worker::arm(self.handle) }
    }

    /// The bounded wait loop behind [`Worker::wait`]; see there.
    #[allow(clippy::disallowed_methods)] // the driver's clock: deadlines of a wait
    pub(crate) fn wait_until(
        &self,
        timeout: Duration,
        policy: &WaitPolicy,
        mut done: impl FnMut() -> bool,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            // Spin while progress makes progress, and for the first
            // `policy.spin` of the wait in any case.
            loop {
                if done() {
                    return Ok(());
                }
                if self.progress() == 0 && start.elapsed() >= policy.spin {
                    break;
                }
            }
            if done() {
                return Ok(());
            }
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                return Err(Error::Refused {
                    op: "wait",
                    reason: UcxReason::WaitTimeout {
                        waited_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
                    },
                });
            }
            let remaining = timeout.saturating_sub(elapsed).min(policy.max_sleep);
            match self.efd {
                Some(fd) => {
                    if self.arm()? {
                        poll_fd(fd, remaining)?;
                    }
                }
                // No event fd: yield the core between progress rounds.
                None => std::thread::yield_now(),
            }
        }
    }
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        self.drain();
        // Every endpoint, every operation and every taken message of this
        // worker held an `Rc<WorkerInner>`, so they are all gone (taken
        // messages released their UCX buffers); release the buffers of the
        // messages never taken.
        self.messages.close(self.handle);
        // SAFETY: `handle` came from `ucp_worker_create`, is destroyed exactly
        // once, here, on the owning thread; no endpoint, request or held
        // message buffer refers to it.
        unsafe { result::worker::destroy(self.handle) };
    }
}

fn poll_fd(fd: RawFd, timeout: Duration) -> Result<()> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // Round up so a sub-millisecond remainder still sleeps a little.
    let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
    // SAFETY: `pfd` is one valid `pollfd` on the stack and nfds = 1; `fd` is
    // the worker's event fd, open for the worker's lifetime.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        if errno != libc::EINTR {
            return Err(Error::Refused {
                op: "wait",
                reason: UcxReason::Os {
                    call: "poll",
                    errno,
                },
            });
        }
    }
    Ok(())
}

/// How [`Worker::wait`] spends its time.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct WaitPolicy {
    /// Busy-progress at least this long before sleeping (shared-memory puts
    /// and flushes complete within microseconds; sleeping would only add
    /// latency).
    pub spin: Duration,
    /// Sleep at most this long at a time in `poll(2)` on the event fd, so an
    /// event a transport does not signal costs at most this much latency.
    pub max_sleep: Duration,
}

impl Default for WaitPolicy {
    fn default() -> Self {
        Self {
            spin: Duration::from_micros(50),
            max_sleep: Duration::from_millis(1),
        }
    }
}

impl WaitPolicy {
    /// The default: spin 50 µs, then sleep on the event fd at most 1 ms at a time.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`WaitPolicy::spin`].
    pub fn spin(mut self, d: Duration) -> Self {
        self.spin = d;
        self
    }

    /// Sets [`WaitPolicy::max_sleep`].
    pub fn max_sleep(mut self, d: Duration) -> Self {
        self.max_sleep = d;
        self
    }
}

/// A UCP worker (`ucp_worker_h`, `UCS_THREAD_MODE_SINGLE`): the progress
/// engine that endpoints and operations belong to.
///
/// `!Send` and `!Sync` (it holds an `Rc`): UCX is told the worker is used by
/// one thread only, and the type system keeps it there. Cheap to clone.
#[derive(Clone)]
pub struct Worker {
    pub(crate) inner: Rc<WorkerInner>,
    policy: WaitPolicy,
}

/// A worker's event fd as an event loop holds it ([`Worker::watch_events`]):
/// it keeps the worker alive, so the fd stays open while it is watched.
pub struct WorkerEvents {
    fd: RawFd,
    _worker: Rc<WorkerInner>,
}

impl std::os::fd::AsRawFd for WorkerEvents {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

impl std::fmt::Debug for WorkerEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerEvents")
            .field("fd", &self.fd)
            .finish()
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("id", &format_args!("{:#018x}", self.inner.id))
            .field("event_fd", &self.inner.efd)
            .finish()
    }
}

impl Context {
    /// Creates a worker on this context.
    pub fn create_worker(&self) -> Result<Worker> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        // SAFETY: live context; `params` fully initialised with only
        // `thread_mode` named in the mask.
        let handle = unsafe { result::worker::create(self.inner.handle, &params) }?;
        // From here `inner` owns the worker and destroys it on any error path.
        let mut inner = WorkerInner {
            handle,
            id: new_id(),
            limits: Limits::new(),
            efd: None,
            max_am_header: 0,
            op_seq: Cell::new(0),
            flushed_through: Cell::new(0),
            deferred: Cell::new(Vec::new()),
            messages: Messages::new(),
            ctx: Rc::clone(&self.inner),
        };
        if self.inner.wakeup {
            // SAFETY: live worker, on its thread, of a context created with
            // `UCP_FEATURE_WAKEUP`. The fd is owned by the worker and closed
            // by `ucp_worker_destroy`.
            let fd = unsafe { result::worker::get_efd(inner.handle) }?;
            inner.efd = Some(fd);
        }
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: u64::from(sys::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER),
            ..Default::default()
        };
        // SAFETY: live worker on its thread; `attr` is a valid, zeroed
        // `ucp_worker_attr_t` asking only for `max_am_header` (nothing UCX
        // allocates, such as the address, is requested).
        unsafe { result::worker::query(inner.handle, &mut attr) }?;
        inner.max_am_header = attr.max_am_header;
        // Peers' blobs are checked against our own address and the rkey of a
        // probe registration of ours; if our own check refuses those (UCX's
        // unified mode, an unknown format), peers cannot be checked either:
        // no worker.
        let own_rkey = {
            let probe = self.register_anon(4096, AnonOptions::new())?;
            probe.pack_rkey()?
        };
        inner.limits =
            Limits::local(&inner.packed_address()?, own_rkey.ucx_bytes()).map_err(|reason| {
                Error::Refused {
                    op: "worker limits",
                    reason,
                }
            })?;
        let inner = Rc::new(inner);
        if let Ok(mut list) = self.inner.workers.try_borrow_mut() {
            list.push(Rc::downgrade(&inner));
        }
        Ok(Worker {
            inner,
            policy: WaitPolicy::default(),
        })
    }
}

impl Worker {
    /// Sets how [`Worker::wait`] spins and sleeps.
    pub fn set_wait_policy(&mut self, policy: WaitPolicy) {
        self.policy = policy;
    }

    /// The worker's random id (carried in its [`WorkerAddress`]).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The id of the context the worker belongs to.
    pub fn context_id(&self) -> u64 {
        self.inner.ctx.id
    }

    /// This worker's address, to send to a peer that will
    /// [`connect`](Worker::connect) to it.
    pub fn address(&self) -> Result<WorkerAddress> {
        let bytes = self.inner.packed_address()?;
        WorkerAddress::seal(self.inner.ctx.id, self.inner.id, &bytes)
    }

    /// What this worker checks peers' packed addresses and rkeys against
    /// ([`Limits::local`]: its own address and the rkey of a probe
    /// registration).
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Connects to a peer worker (`ucp_ep_create` from its address, with
    /// `UCP_ERR_HANDLING_MODE_PEER` when the context's [`ErrorMode`] is
    /// `Peer`, so a dead peer fails operations instead of hanging them).
    /// Connection establishment is lazy in UCX: errors may surface on the
    /// first operation rather than here.
    ///
    /// The packed UCX address is validated again before `ucp_ep_create`
    /// sees it, now against this worker's [`limits`](Worker::limits)
    /// ([`UcxReason::MalformedAddress`]).
    ///
    /// [`ErrorMode`]: super::ErrorMode
    pub fn connect(&self, peer: &WorkerAddress) -> Result<Endpoint> {
        Endpoint::create(&self.inner, peer)
    }

    /// Whether an endpoint to `peer` would attach this host's shared memory
    /// ([`attaches_shared_memory`](crate::attaches_shared_memory) against
    /// this worker's limits): UCX keeps what it attaches until the worker
    /// goes, while a route to another host attaches nothing.
    pub fn attaches_shared_memory(&self, peer: &WorkerAddress) -> bool {
        super::binding::attaches_shared_memory(peer.ucx_bytes(), &self.inner.limits)
    }

    /// [`connect`](Worker::connect), once the address proves to reach only
    /// its own process through this worker's transports
    /// ([`validate_process_binding`](crate::validate_process_binding);
    /// [`UcxReason::MalformedAddress`] with
    /// [`AddressProblem::ForeignProcess`](crate::AddressProblem::ForeignProcess)
    /// otherwise): a cma iface naming another pid than the posix fifo's, or
    /// beside a sysv fifo, or a knem or xpmem iface, is refused.
    pub fn connect_bound(&self, peer: &WorkerAddress) -> Result<Endpoint> {
        super::binding::validate_process_binding(peer.ucx_bytes(), &self.inner.limits).map_err(
            |reason| crate::Error::Refused {
                op: "ucp_ep_create",
                reason,
            },
        )?;
        self.connect(peer)
    }

    /// One round of `ucp_worker_progress`; returns how many events it handled.
    pub fn progress(&self) -> u32 {
        self.inner.progress()
    }

    /// The worker's event fd registered with the current tokio runtime for
    /// readable events (`None` without wakeup, or where the runtime refuses
    /// it). The returned value keeps the worker (so its fd) alive until it is
    /// dropped, which deregisters the fd first. Before sleeping on it, call
    /// [`Worker::arm`]. Must be called inside a tokio runtime.
    pub fn watch_events(&self) -> Option<tokio::io::unix::AsyncFd<WorkerEvents>> {
        let fd = self.inner.efd?;
        let events = WorkerEvents {
            fd,
            _worker: Rc::clone(&self.inner),
        };
        // SAFETY: `fd` is the worker's event fd, open until
        // `ucp_worker_destroy`, which runs only when the last `Rc` of the
        // worker is dropped: `events` holds one, and the `AsyncFd` owns
        // `events` until it has deregistered the fd. `as_raw_fd` always
        // returns this same fd.
        unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(events, tokio::io::Interest::READABLE)
        }
        .ok()
    }

    /// The worker's event fd (`ucp_worker_get_efd`), when the context has
    /// wakeup. Register it with an event loop (epoll, tokio `AsyncFd`); before
    /// sleeping on it, call [`Worker::arm`].
    pub fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        // SAFETY: the fd is owned by the worker and stays open until
        // `ucp_worker_destroy`, which cannot run while `&self` is borrowed.
        self.inner
            .efd
            .map(|fd| unsafe { BorrowedFd::borrow_raw(fd) })
    }

    /// `ucp_worker_arm`: `Ok(true)` when the event fd is armed and it is safe
    /// to sleep on it; `Ok(false)` when events are pending and the caller must
    /// [`progress`](Worker::progress) first. Without wakeup, always `Ok(false)`.
    pub fn arm(&self) -> Result<bool> {
        if self.inner.efd.is_none() {
            return Ok(false);
        }
        self.inner.arm()
    }

    /// Flushes every endpoint of this worker (`ucp_worker_flush_nbx`): when
    /// the completion is `Ok`, every put issued before the flush is remotely
    /// complete.
    pub fn flush(&self) -> Result<Completion> {
        let seq = self.inner.op_seq.get();
        let state = OpState::new(
            "ucp_worker_flush_nbx",
            OpKind::WorkerFlush { seq },
            Rc::clone(&self.inner),
            None,
            None,
            None,
        );
        let handle = self.inner.handle;
        submit(state, None, |param| {
            // SAFETY: live worker on its thread; `param` is a fully
            // initialised request param with a completion callback whose
            // user data `submit` manages.
            unsafe { result::worker::flush_nbx(handle, param) }
        })
    }

    /// Waits until `op` completes, then returns its outcome; or fails with
    /// [`UcxReason::WaitTimeout`] after `timeout` (the operation stays in
    /// flight; wait again or give up on it — its memory stays in use).
    ///
    /// The wait spins on `ucp_worker_progress` for [`WaitPolicy::spin`]
    /// (shared-memory operations finish in microseconds), then alternates
    /// progress with `ucp_worker_arm` + `poll(2)` on the event fd, sleeping
    /// at most [`WaitPolicy::max_sleep`] at a time; without wakeup it yields
    /// the core between rounds instead. It never burns a core for longer than
    /// the spin phase, and never waits past `timeout`.
    ///
    /// `op` must belong to this worker ([`UcxReason::WorkerMismatch`]).
    pub fn wait(&self, op: &Completion, timeout: Duration) -> Result<()> {
        if !Rc::ptr_eq(op.worker(), &self.inner) {
            return Err(Error::Refused {
                op: "wait",
                reason: UcxReason::WorkerMismatch,
            });
        }
        self.inner
            .wait_until(timeout, &self.policy, || op.is_done())?;
        op.result().unwrap_or(Ok(()))
    }

    /// Waits for all of `ops` (see [`Worker::wait`]); returns the first error.
    pub fn wait_all(&self, ops: &[Completion], timeout: Duration) -> Result<()> {
        if ops.iter().any(|op| !Rc::ptr_eq(op.worker(), &self.inner)) {
            return Err(Error::Refused {
                op: "wait",
                reason: UcxReason::WorkerMismatch,
            });
        }
        self.inner.wait_until(timeout, &self.policy, || {
            ops.iter().all(Completion::is_done)
        })?;
        ops.iter()
            .find_map(|op| op.result().and_then(Result::err))
            .map_or(Ok(()), Err)
    }

    /// Progresses this worker (spin, then sleep on the event fd, as
    /// [`Worker::wait`]) until `done()` returns true or `timeout` passes.
    /// For conditions that are not a single [`Completion`] — e.g. a
    /// destination waiting for its control channel while UCX (tcp) needs its
    /// worker progressed to land incoming puts.
    pub fn progress_until(&self, timeout: Duration, done: impl FnMut() -> bool) -> Result<()> {
        self.inner.wait_until(timeout, &self.policy, done)
    }
}
