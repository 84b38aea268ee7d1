//! Endpoints, remote keys, and the data-path calls: `put`, `flush` and
//! `send_message`.

use std::cell::Cell;
use std::ffi::c_void;
use std::ptr;
use std::rc::Rc;
use std::time::Duration;

use super::context::ErrorMode;
use super::memory::Registration;
use super::packed::{validate_rkey, validate_worker_address};
use super::request::{
    Completion, MessageBuffers, MessageHold, OpKind, OpState, RequestExtras, submit, submit_with,
};
use super::result::request::{ptr_is_err, ptr_status};
use super::wire::{RkeyBuffer, WorkerAddress};
use super::worker::{WaitPolicy, WorkerInner};
use super::{UcsStatus, UcxReason, result, sys};
use crate::error::{Error, Result};

/// How long an endpoint's `Drop` waits for a flush-mode close, and a remote
/// key's `Drop` for the flush of its unflushed puts.
pub const DROP_WAIT: Duration = Duration::from_secs(1);

/// Zero bytes appended after a blob copied for UCX, which parses worker
/// addresses and rkeys without a length: if a malformed-but-well-framed blob
/// makes UCX read past its end, it reads these, not foreign memory.
const UCX_PARSE_PAD: usize = 1024;

/// How an endpoint is closed when its last handle goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseMode {
    /// Flush outstanding operations, then close (`ucp_ep_close_nbx` without
    /// flags); the default for a healthy endpoint.
    Flush,
    /// Close at once (`UCP_EP_CLOSE_FLAG_FORCE`): outstanding operations
    /// complete with [`UcsStatus::Canceled`]. Used automatically once the
    /// endpoint has failed; set it explicitly to abandon a stalled peer.
    /// UCX allows it only with [`ErrorMode::Peer`] on both sides; on an
    /// [`ErrorMode::None`] endpoint the close stays in flush mode.
    Force,
    /// Close without waiting on the peer, for an endpoint with nothing
    /// left to flush that the caller is done with (every put on it was
    /// flushed, or none was made) and whose peer may never progress: a
    /// forced close with [`ErrorMode::Peer`]; otherwise a flush-mode close
    /// that is requested and not waited for (UCX finishes it when the peer
    /// answers, or when the worker is destroyed). A flush-mode close of an
    /// endpoint whose wireup a silent shared-memory peer never answered
    /// waited the whole [`DROP_WAIT`].
    Detach,
}

fn input(op: &'static str, reason: UcxReason) -> Error {
    Error::Refused { op, reason }
}

/// The error handler UCX calls (from `ucp_worker_progress`) when the
/// connection to the peer fails.
///
/// # Safety
///
/// `arg` must be the pointer produced by `Rc::into_raw` for the endpoint's
/// failure cell, still owned by the endpoint (or deliberately leaked).
unsafe extern "C" fn ep_err_cb(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: per the contract, `arg` points at a live `Cell<Option<i8>>`
    // (the endpoint holds one strong reference until the UCX endpoint is
    // closed, and leaks it if the close never completes). Only a shared
    // reference is formed; `Cell` is the interior mutability.
    let failed = unsafe { &*arg.cast_const().cast::<Cell<Option<i8>>>() };
    if failed.get().is_none() {
        failed.set(Some(status));
    }
}

/// Shared state of an endpoint. Remote keys and in-flight operations hold an
/// `Rc` to it, so the UCX endpoint is closed only after every rkey unpacked
/// on it is destroyed and every operation on it has completed.
///
/// Field order is load-bearing: `Drop::drop` closes `handle`; then the
/// `worker` reference is released last, so the worker outlives the endpoint.
pub(crate) struct EndpointInner {
    handle: Cell<sys::ucp_ep_h>,
    /// The first failure UCX reported (error handler, or an operation that
    /// completed with a peer failure).
    pub(crate) failed: FailedView,
    /// `Rc::into_raw` of another reference to `failed`'s cell: the error
    /// handler's argument.
    err_arg: *const Cell<Option<i8>>,
    close_mode: Cell<CloseMode>,
    error_mode: ErrorMode,
    /// Puts up to this sequence number are remotely complete (an endpoint
    /// flush issued after them completed).
    pub(crate) flushed_through: Cell<u64>,
    peer_context: u64,
    peer_worker: u64,
    pub(crate) worker: Rc<WorkerInner>,
}

/// A typed view of the endpoint's failure cell.
pub(crate) struct FailedView(Rc<Cell<Option<i8>>>);

impl FailedView {
    pub(crate) fn get(&self) -> Option<UcsStatus> {
        self.0.get().map(UcsStatus::from_raw)
    }

    pub(crate) fn set(&self, status: Option<UcsStatus>) {
        self.0.set(status.map(UcsStatus::raw));
    }
}

impl EndpointInner {
    fn usable(&self, op: &'static str) -> Result<sys::ucp_ep_h> {
        let h = self.handle.get();
        if h.is_null() {
            return Err(input(op, UcxReason::EndpointClosed));
        }
        if let Some(status) = self.failed.get() {
            return Err(input(op, UcxReason::EndpointFailed(status)));
        }
        Ok(h)
    }

    /// Closes the UCX endpoint; never panics, records failures.
    fn close(&self) {
        let h = self.handle.replace(ptr::null_mut());
        if h.is_null() {
            return;
        }
        let mode = self.close_mode.get();
        let force = self.error_mode == ErrorMode::Peer
            && (self.failed.get().is_some()
                || matches!(mode, CloseMode::Force | CloseMode::Detach));
        // Detached only without peer error handling (with it, `force`): UCX
        // then never had the error handler's argument, so the close needs
        // no completion.
        let detach = mode == CloseMode::Detach && self.error_mode != ErrorMode::Peer;
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force {
                sys::UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: `h` is the live endpoint (taken out of `handle`, so closed
        // exactly once) on the worker's thread; `param` is fully initialised
        // and has no callback, so the returned request is polled below.
        let req = unsafe { result::endpoint::close_nbx(h, &param) };
        let mut outcome = if req.is_null() {
            Ok(())
        } else if ptr_is_err(req) {
            Err(UcsStatus::from_raw(ptr_status(req)))
        } else if detach {
            // SAFETY: `req` is a live request returned by `ucp_ep_close_nbx`,
            // freed exactly once, here; UCX finishes the close internally
            // ("regardless of its state"). Nothing of ours is left for it:
            // every operation and remote key on this endpoint is gone (each
            // held a reference), and the error handler was never given.
            unsafe { result::request::free(req) };
            Ok(())
        } else {
            let status = Cell::new(sys::UCS_INPROGRESS);
            let waited = self
                .worker
                .wait_until(DROP_WAIT, &WaitPolicy::default(), || {
                    // SAFETY: `req` is a live request returned by
                    // `ucp_ep_close_nbx`, not yet freed (it is freed only below).
                    status.set(unsafe { result::request::check_status(req) });
                    status.get() != sys::UCS_INPROGRESS
                });
            // SAFETY: `req` is freed exactly once; if still in progress, UCX
            // finishes the close internally ("regardless of its state").
            unsafe { result::request::free(req) };
            match (waited, status.get()) {
                (Ok(()), sys::UCS_OK) => Ok(()),
                (Ok(()), raw) => Err(UcsStatus::from_raw(raw)),
                (Err(_), _) => Err(UcsStatus::TimedOut),
            }
        };
        if force && outcome == Err(UcsStatus::Canceled) {
            outcome = Ok(());
        }
        match outcome {
            Ok(()) => {
                // The UCX endpoint is gone: its error handler can no longer
                // run, so the handler's reference is reclaimed.
                // SAFETY: `err_arg` came from `Rc::into_raw` in
                // `Endpoint::create` and is reclaimed exactly once, here.
                drop(unsafe { Rc::from_raw(self.err_arg) });
            }
            Err(status) => {
                // With peer error handling the close may still be running
                // inside UCX and could call the error handler later: its
                // reference stays leaked (a few bytes) rather than risk a
                // dangling pointer. Without it UCX was never given the
                // handler or its argument (`Endpoint::create`), so nothing
                // can call it and the reference is reclaimed.
                if self.error_mode != ErrorMode::Peer {
                    // SAFETY: `err_arg` came from `Rc::into_raw` in
                    // `Endpoint::create`, was never handed to UCX in this
                    // mode, and is reclaimed exactly once, here.
                    drop(unsafe { Rc::from_raw(self.err_arg) });
                }
                let failed_peer = self.failed.get().is_some();
                if !(failed_peer && status.is_peer_failure()) {
                    self.worker.ctx.record(Error::Call {
                        op: "ucp_ep_close_nbx",
                        status,
                    });
                }
            }
        }
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        // Every rkey unpacked on this endpoint and every operation on it held
        // an `Rc<EndpointInner>`: they are destroyed/completed already.
        self.close();
    }
}

/// A connection to a peer worker (`ucp_ep_h`), created by
/// [`Worker::connect`](super::Worker::connect). `!Send`; cheap to clone.
///
/// Dropping the last handle (and the last [`RemoteKey`] unpacked on it)
/// closes the endpoint: flush mode (bounded by [`DROP_WAIT`]) while healthy;
/// with [`ErrorMode::Peer`], force mode once it has failed or after
/// [`set_close_mode(Force)`](Endpoint::set_close_mode); not waited for after
/// [`set_close_mode(Detach)`](Endpoint::set_close_mode).
#[derive(Clone)]
pub struct Endpoint {
    pub(crate) inner: Rc<EndpointInner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field(
                "peer_context",
                &format_args!("{:#018x}", self.inner.peer_context),
            )
            .field(
                "peer_worker",
                &format_args!("{:#018x}", self.inner.peer_worker),
            )
            .field("failed", &self.inner.failed.get())
            .finish()
    }
}

impl Endpoint {
    pub(crate) fn create(worker: &Rc<WorkerInner>, peer: &WorkerAddress) -> Result<Self> {
        // UCX 1.13 has no parse safety: only a well-formed address within
        // this context's bounds goes on (checked here, whatever the caller
        // did before).
        validate_worker_address(peer.ucx_bytes(), &worker.limits)
            .map_err(|r| input("ucp_ep_create", r))?;
        let failed_cell = Rc::new(Cell::new(None));
        let err_arg = Rc::into_raw(Rc::clone(&failed_cell));
        let inner = Rc::new(EndpointInner {
            handle: Cell::new(ptr::null_mut()),
            failed: FailedView(failed_cell),
            err_arg,
            close_mode: Cell::new(CloseMode::Flush),
            error_mode: worker.ctx.error_mode,
            flushed_through: Cell::new(0),
            peer_context: peer.context_id(),
            peer_worker: peer.worker_id(),
            worker: Rc::clone(worker),
        });
        // UCX parses the address without a length: hand it a padded copy.
        let mut addr = Vec::with_capacity(peer.ucx_bytes().len() + UCX_PARSE_PAD);
        addr.extend_from_slice(peer.ucx_bytes());
        addr.resize(peer.ucx_bytes().len() + UCX_PARSE_PAD, 0);
        let mut params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
            ),
            address: addr.as_ptr().cast::<sys::ucp_address_t>(),
            err_mode: sys::UCP_ERR_HANDLING_MODE_NONE,
            ..Default::default()
        };
        if inner.error_mode == ErrorMode::Peer {
            params.field_mask |= u64::from(sys::UCP_EP_PARAM_FIELD_ERR_HANDLER);
            params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler = sys::ucp_err_handler_t {
                cb: Some(ep_err_cb),
                arg: err_arg.cast_mut().cast::<c_void>(),
            };
        }
        // SAFETY: live worker on its thread; `params.address` points at the
        // peer's packed address (envelope checked by `from_bytes`, the
        // packed address walked against this worker's limits above, a padded
        // copy alive for the call); the error handler's `arg` is the leaked failure cell,
        // valid for as long as the UCX endpoint can exist (see
        // `EndpointInner::close`).
        let created = unsafe { result::endpoint::create(worker.handle, &params) };
        let handle = match created {
            Ok(handle) => handle,
            Err(e) => {
                // No UCX endpoint exists: reclaim the handler's reference.
                // SAFETY: `err_arg` came from `Rc::into_raw` above and UCX never
                // stored it (creation failed); reclaimed exactly once.
                drop(unsafe { Rc::from_raw(inner.err_arg) });
                // `inner` has a null handle, so its `Drop` closes nothing.
                return Err(e);
            }
        };
        inner.handle.set(handle);
        Ok(Self { inner })
    }

    /// The peer's context id (from its [`WorkerAddress`]).
    pub fn peer_context_id(&self) -> u64 {
        self.inner.peer_context
    }

    /// The peer's worker id (from its [`WorkerAddress`]).
    pub fn peer_worker_id(&self) -> u64 {
        self.inner.peer_worker
    }

    /// The first failure UCX reported on this endpoint, if any. A failed
    /// endpoint refuses new operations; drop it and connect again.
    pub fn failure(&self) -> Option<UcsStatus> {
        self.inner.failed.get()
    }

    /// How the endpoint is closed when its last reference goes away.
    pub fn set_close_mode(&self, mode: CloseMode) {
        self.inner.close_mode.set(mode);
    }

    /// Unpacks a peer's rkey for use with this endpoint. The rkey must have
    /// been packed by the context of this endpoint's peer
    /// ([`UcxReason::ForeignRkey`] otherwise); its envelope and UCX structure
    /// were validated by [`RkeyBuffer::from_bytes`], and the packed rkey is
    /// validated again here, against the worker's
    /// [`limits`](super::Worker::limits), before `ucp_ep_rkey_unpack` sees it.
    pub fn unpack_rkey(&self, rkey: &RkeyBuffer) -> Result<RemoteKey> {
        let op = "ucp_ep_rkey_unpack";
        if rkey.context_id() != self.inner.peer_context {
            return Err(input(
                op,
                UcxReason::ForeignRkey {
                    rkey_context: rkey.context_id(),
                    peer_context: self.inner.peer_context,
                },
            ));
        }
        let ucx = rkey.ucx_bytes();
        validate_rkey(ucx, &self.inner.worker.limits).map_err(|r| input(op, r))?;
        let ep = self.inner.usable(op)?;
        let mut padded = Vec::with_capacity(ucx.len() + UCX_PARSE_PAD);
        padded.extend_from_slice(ucx);
        padded.resize(ucx.len() + UCX_PARSE_PAD, 0);
        // SAFETY: live endpoint on the worker's thread; `padded` holds a
        // structurally checked packed rkey followed by zero padding and lives
        // across the call (UCX copies what it keeps); the rkey is destroyed
        // before the endpoint closes (`RkeyInner` holds the endpoint).
        let handle =
            unsafe { result::endpoint::rkey_unpack(ep, padded.as_ptr().cast::<c_void>()) }?;
        Ok(RemoteKey {
            inner: Rc::new(RkeyInner {
                handle,
                base: rkey.base(),
                len: rkey.len(),
                last_put_seq: Cell::new(0),
                ep: Rc::clone(&self.inner),
            }),
        })
    }

    /// `ucp_put_nbx`: copies `len` bytes at `local_offset` of the local
    /// registration into the peer's registration at `remote_offset`.
    ///
    /// Checked before UCX is called: the local range lies inside `local`
    /// ([`UcxReason::LocalRange`]); `local` belongs to this worker's context
    /// ([`UcxReason::ContextMismatch`]); `remote` was unpacked on this
    /// endpoint ([`UcxReason::RkeyEndpoint`]); the remote range lies inside
    /// the registration the rkey was packed from ([`UcxReason::RemoteRange`]).
    /// Which part of the remote registration the destination *granted* is the
    /// protocol's business, not this layer's.
    ///
    /// The completion means local completion (the source bytes may change
    /// again). The destination sees the bytes once a flush issued after the
    /// put completes `Ok` ([`Endpoint::flush`]). A zero-length put completes
    /// at once. Cap the number of puts in flight on tcp (an unbounded number
    /// of large puts collapses throughput).
    pub fn put(
        &self,
        local: &Registration<'_>,
        local_offset: usize,
        len: usize,
        remote: &RemoteKey,
        remote_offset: u64,
    ) -> Result<Completion> {
        let op = "ucp_put_nbx";
        if !Rc::ptr_eq(&remote.inner.ep, &self.inner) {
            return Err(input(op, UcxReason::RkeyEndpoint));
        }
        if !Rc::ptr_eq(local.context_inner(), &self.inner.worker.ctx) {
            return Err(input(op, UcxReason::ContextMismatch));
        }
        let src = local
            .range_ptr(local_offset, len)
            .map_err(|r| input(op, r))?;
        let remote_addr = remote.remote_addr(remote_offset, len as u64)?;
        let ep = self.inner.usable(op)?;
        let worker = &self.inner.worker;
        let seq = worker.next_seq();
        remote.inner.last_put_seq.set(seq);
        let state = OpState::new(
            op,
            OpKind::Put,
            Rc::clone(worker),
            Some(Rc::clone(&self.inner)),
            Some(Rc::clone(&remote.inner)),
            Some(Rc::clone(local.core())),
        );
        if len == 0 {
            return Ok(Completion::done(state));
        }
        let rkey = remote.inner.handle;
        submit(state, Some(local.memh()), |param| {
            // SAFETY: live endpoint and rkey (unpacked on this endpoint, kept
            // alive by the operation state until completion); `src..src+len`
            // lies inside the live registration `local` (checked above), whose
            // teardown waits for this put's completion (in-flight count);
            // `remote_addr..+len` lies inside the peer's registration as its
            // rkey describes; `param` carries the completion callback and the
            // registration's `memh`.
            unsafe {
                result::endpoint::put_nbx(ep, src.cast::<c_void>(), len, remote_addr, rkey, param)
            }
        })
    }

    /// `ucp_am_send_nbx` with `UCP_AM_SEND_FLAG_EAGER`: an active message
    /// with `id`, `header` (copied; the copy is kept until the send
    /// completes) and the data gathered from `parts`, each `(registration,
    /// offset, len)`, in order. The peer receives it if it
    /// [accepts](super::Worker::accept_messages) `id` within its limits.
    ///
    /// Checked before UCX is called: the header fits the worker's
    /// [`max_message_header`](super::Worker::max_message_header)
    /// ([`UcxReason::TooLarge`]; UCX 1.13 does not check, and overruns its
    /// fragment buffer); for every part, the range lies inside its
    /// registration ([`UcxReason::LocalRange`]), which belongs to this
    /// worker's context ([`UcxReason::ContextMismatch`]). No parts sends the
    /// header alone; one part goes as a contiguous buffer (with its `memh`),
    /// more as an iov array (`ucp_dt_make_iov()`) that the operation keeps
    /// alive.
    ///
    /// Eager, never rendezvous (a receiver drops rendezvous messages): large
    /// messages go as many fragments that UCX reassembles at the receiver.
    /// The completion means local completion: the parts may change again.
    /// Each part's registration counts the send as in flight until then, as
    /// [`put`](Endpoint::put) does, so its teardown waits for it.
    pub fn send_message(
        &self,
        id: u16,
        header: &[u8],
        parts: &[(&Registration<'_>, usize, usize)],
    ) -> Result<Completion> {
        let op = "ucp_am_send_nbx";
        let max = self.inner.worker.max_am_header;
        if header.len() > max {
            return Err(input(
                op,
                UcxReason::TooLarge {
                    what: "active message header",
                    len: header.len(),
                    max,
                },
            ));
        }
        let mut iov = Vec::with_capacity(parts.len());
        let mut regs = Vec::with_capacity(parts.len());
        for &(reg, offset, len) in parts {
            if !Rc::ptr_eq(reg.context_inner(), &self.inner.worker.ctx) {
                return Err(input(op, UcxReason::ContextMismatch));
            }
            let src = reg.range_ptr(offset, len).map_err(|r| input(op, r))?;
            iov.push(sys::ucp_dt_iov_t {
                buffer: src.cast::<c_void>(),
                length: len,
            });
            regs.push(Rc::clone(reg.core()));
        }
        let ep = self.inner.usable(op)?;
        let mut extras = RequestExtras {
            flags: sys::UCP_AM_SEND_FLAG_EAGER,
            ..RequestExtras::default()
        };
        // One part goes as a contiguous buffer with its `memh` (no iov array).
        let contig = match parts {
            [(reg, _, _)] => {
                extras.memh = Some(reg.memh());
                iov.pop()
            }
            _ => None,
        };
        let bufs = MessageBuffers::new(header, iov);
        let (header_ptr, header_len) = bufs.header();
        let (buffer, count) = match contig {
            Some(one) => (one.buffer.cast_const(), one.length),
            None if parts.is_empty() => (ptr::null(), 0),
            None => {
                extras.datatype = Some(sys::ucp_datatype_t::from(sys::UCP_DATATYPE_IOV));
                bufs.iov()
            }
        };
        let worker = &self.inner.worker;
        let state = OpState::new(
            op,
            OpKind::Message(MessageHold::new(regs, bufs)),
            Rc::clone(worker),
            Some(Rc::clone(&self.inner)),
            None,
            None,
        );
        submit_with(state, extras, |param| {
            // SAFETY: live endpoint on the worker's thread; `header_ptr` is
            // null with length 0 or the header copy, and `buffer` is null
            // with count 0, one part's range, or the iov array of the parts'
            // ranges — the copy and the array owned by the operation state,
            // the ranges inside live registrations (checked above) whose
            // teardown waits for this send (in-flight counts), all kept until
            // UCX completes the send; `param` carries the completion
            // callback, the eager flag, and the `memh` of a single part or
            // the iov datatype.
            unsafe {
                result::endpoint::am_send_nbx(
                    ep,
                    u32::from(id),
                    header_ptr,
                    header_len,
                    buffer,
                    count,
                    param,
                )
            }
        })
    }

    /// `ucp_ep_flush_nbx`: when the completion is `Ok`, every put issued on
    /// this endpoint before the flush is visible at the destination.
    pub fn flush(&self) -> Result<Completion> {
        let op = "ucp_ep_flush_nbx";
        let ep = self.inner.usable(op)?;
        let worker = &self.inner.worker;
        let state = OpState::new(
            op,
            OpKind::EpFlush {
                seq: worker.op_seq.get(),
            },
            Rc::clone(worker),
            Some(Rc::clone(&self.inner)),
            None,
            None,
        );
        submit(state, None, |param| {
            // SAFETY: live endpoint on the worker's thread; `param` carries
            // the completion callback whose user data `submit` manages.
            unsafe { result::endpoint::flush_nbx(ep, param) }
        })
    }
}

/// Shared state of an unpacked rkey. In-flight puts hold an `Rc` to it.
///
/// Field order is load-bearing: `Drop::drop` destroys `handle` (after
/// flushing unflushed puts); then `ep` is released, so the rkey is destroyed
/// before the endpoint it was unpacked on, as UCX requires.
pub(crate) struct RkeyInner {
    handle: sys::ucp_rkey_h,
    base: u64,
    len: u64,
    last_put_seq: Cell<u64>,
    pub(crate) ep: Rc<EndpointInner>,
}

impl Drop for RkeyInner {
    fn drop(&mut self) {
        // UCX: an rkey is destroyed only after the operations that used it
        // are flushed. Puts hold this rkey until local completion; remote
        // completion needs a flush issued after the last put.
        let last = self.last_put_seq.get();
        let flushed = self
            .ep
            .flushed_through
            .get()
            .max(self.ep.worker.flushed_through.get());
        if last > flushed
            && let Ok(ep) = self.ep.usable("ucp_ep_flush_nbx")
        {
            let worker = &self.ep.worker;
            let state = OpState::new(
                "ucp_ep_flush_nbx",
                OpKind::EpFlush { seq: last },
                Rc::clone(worker),
                None,
                None,
                None,
            );
            let flushed = submit(state, None, |param| {
                // SAFETY: live endpoint (this rkey holds it) on the worker's
                // thread; `param` carries the completion callback.
                unsafe { result::endpoint::flush_nbx(ep, param) }
            })
            .and_then(|c| {
                worker.wait_until(DROP_WAIT, &WaitPolicy::default(), || c.is_done())?;
                c.result().unwrap_or(Ok(()))
            });
            if let Err(e) = flushed {
                let peer_gone = e.status().is_some_and(UcsStatus::is_peer_failure);
                if !peer_gone {
                    // Unflushed puts may still use the rkey: leak it (UCX
                    // frees it with the worker) rather than destroy it early.
                    self.ep.worker.ctx.record(e);
                    return;
                }
            }
        }
        // SAFETY: `handle` came from `ucp_ep_rkey_unpack` on `self.ep`, which
        // is still open (this struct holds it); no operation uses the rkey any
        // more (puts held this struct until they completed, and the puts are
        // flushed or the endpoint has failed); destroyed exactly once.
        unsafe { result::endpoint::rkey_destroy(self.handle) };
    }
}

/// A peer's rkey unpacked on one [`Endpoint`] (`ucp_rkey_h`), with the base
/// and length of the remote registration it grants access to. `!Send`;
/// cheap to clone. Usable only with the endpoint it was unpacked on.
#[derive(Clone)]
pub struct RemoteKey {
    inner: Rc<RkeyInner>,
}

impl std::fmt::Debug for RemoteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKey")
            .field("base", &format_args!("{:#x}", self.inner.base))
            .field("len", &self.inner.len)
            .finish()
    }
}

impl RemoteKey {
    /// The remote registration's length in bytes.
    pub fn remote_len(&self) -> u64 {
        self.inner.len
    }

    fn remote_addr(&self, offset: u64, len: u64) -> Result<u64> {
        let size = self.inner.len;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(self.inner.base.wrapping_add(offset)),
            _ => Err(input(
                "ucp_put_nbx",
                UcxReason::RemoteRange { offset, len, size },
            )),
        }
    }
}
