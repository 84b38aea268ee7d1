//! Non-blocking operations (`put`, active-message sends, flushes) and their
//! completion.
//!
//! Every operation is submitted with a UCX completion callback whose
//! `user_data` is an `Rc<OpState>` turned into a raw pointer. The callback
//! takes that reference back, records the status, and frees the UCX request —
//! so an operation completes (and releases what it keeps alive) whether or not
//! anybody still holds its [`Completion`]. Dropping or even leaking a
//! `Completion` therefore never leaves UCX pointing at freed Rust memory:
//! the `OpState` keeps the endpoint, the remote key, the registrations'
//! in-flight counters and a message's header and iov array alive until UCX
//! says the operation is over.

use std::cell::Cell;
use std::ffi::c_void;
use std::rc::Rc;

use super::endpoint::{EndpointInner, RkeyInner};
use super::memory::RegCore;
use super::result::request::{ptr_is_err, ptr_status};
use super::worker::{Deferred, WorkerInner};
use super::{UcsStatus, result, sys};
use crate::error::{Error, Result};

/// What an operation is, and what it must update when it completes.
pub(crate) enum OpKind {
    /// A put; decrements the registration's in-flight count.
    Put,
    /// An active message; releases its buffers and decrements its parts'
    /// registrations' in-flight counts.
    Message(MessageHold),
    /// An endpoint flush covering puts up to `seq`.
    EpFlush { seq: u64 },
    /// A worker flush covering puts up to `seq`.
    WorkerFlush { seq: u64 },
}

/// What an active-message send keeps until it completes: the registrations
/// its parts come from (one entry per part, so a registration used twice is
/// counted twice) and its header and iov array.
pub(crate) struct MessageHold {
    regs: Cell<Vec<Rc<RegCore>>>,
    bufs: Cell<Option<MessageBuffers>>,
}

impl MessageHold {
    pub(crate) fn new(regs: Vec<Rc<RegCore>>, bufs: MessageBuffers) -> Self {
        Self {
            regs: Cell::new(regs),
            bufs: Cell::new(Some(bufs)),
        }
    }
}

/// A message's header copy and iov array, which UCX may read until the send
/// completes. Kept as `Box::into_raw` pointers, so moving them (into the
/// operation state) never retags the boxes while UCX holds their addresses;
/// freed on drop.
pub(crate) struct MessageBuffers {
    header: *mut [u8],
    iov: *mut [sys::ucp_dt_iov_t],
}

impl MessageBuffers {
    pub(crate) fn new(header: &[u8], iov: Vec<sys::ucp_dt_iov_t>) -> Self {
        Self {
            header: Box::into_raw(Box::<[u8]>::from(header)),
            iov: Box::into_raw(iov.into_boxed_slice()),
        }
    }

    /// The header copy and its length (null when empty, as UCX asks).
    pub(crate) fn header(&self) -> (*const c_void, usize) {
        let len = self.header.len();
        if len == 0 {
            (std::ptr::null(), 0)
        } else {
            (self.header.cast_const().cast::<c_void>(), len)
        }
    }

    /// The iov array and its number of entries.
    pub(crate) fn iov(&self) -> (*const c_void, usize) {
        (self.iov.cast_const().cast::<c_void>(), self.iov.len())
    }
}

impl Drop for MessageBuffers {
    fn drop(&mut self) {
        // SAFETY: both pointers came from `Box::into_raw` in `new` and are
        // reconstituted exactly once, here; UCX no longer reads them (the
        // buffers are dropped when the send completed, or never handed over).
        drop(unsafe { Box::from_raw(self.header) });
        // SAFETY: as above.
        drop(unsafe { Box::from_raw(self.iov) });
    }
}

/// The state shared by a submitted operation, its UCX callback and its
/// [`Completion`] handle.
///
/// Field order: `status` and `kind` are plain data; the `Rc`s below are
/// released by [`OpState::complete`] (not by field drop order), so the
/// registration's in-flight count drops and the rkey/endpoint may be
/// destroyed as soon as UCX reports the operation complete.
pub(crate) struct OpState {
    op: &'static str,
    status: Cell<Option<i8>>,
    kind: OpKind,
    reg: Cell<Option<Rc<RegCore>>>,
    rkey: Cell<Option<Rc<RkeyInner>>>,
    ep: Cell<Option<Rc<EndpointInner>>>,
    /// Kept until the state itself is dropped: a completion can always be
    /// waited on through its worker.
    worker: Rc<WorkerInner>,
}

impl OpState {
    pub(crate) fn new(
        op: &'static str,
        kind: OpKind,
        worker: Rc<WorkerInner>,
        ep: Option<Rc<EndpointInner>>,
        rkey: Option<Rc<RkeyInner>>,
        reg: Option<Rc<RegCore>>,
    ) -> Rc<Self> {
        if let (OpKind::Put, Some(reg)) = (&kind, &reg) {
            reg.inflight.set(reg.inflight.get().saturating_add(1));
        }
        if let OpKind::Message(hold) = &kind {
            let regs = hold.regs.take();
            for reg in &regs {
                reg.inflight.set(reg.inflight.get().saturating_add(1));
            }
            hold.regs.set(regs);
        }
        Rc::new(Self {
            op,
            status: Cell::new(None),
            kind,
            reg: Cell::new(reg),
            rkey: Cell::new(rkey),
            ep: Cell::new(ep),
            worker,
        })
    }

    /// Records the final status exactly once and releases the resources the
    /// operation kept alive. Called from the UCX callback (inside
    /// `ucp_worker_progress`) or right after submission for immediate
    /// completions. Never panics (it may run inside an `extern "C"` callback).
    pub(crate) fn complete(&self, raw: i8) {
        if self.status.get().is_some() {
            return;
        }
        self.status.set(Some(raw));
        let ok = raw == sys::UCS_OK;
        let ep = self.ep.take();
        match &self.kind {
            OpKind::Put => {
                if let Some(reg) = self.reg.take() {
                    reg.inflight.set(reg.inflight.get().saturating_sub(1));
                    self.worker.defer(Deferred::Registration(reg));
                }
            }
            OpKind::Message(hold) => {
                // UCX is done with the header and the iov array: free them
                // (plain heap memory, fine inside a callback).
                drop(hold.bufs.take());
                for reg in hold.regs.take() {
                    reg.inflight.set(reg.inflight.get().saturating_sub(1));
                    self.worker.defer(Deferred::Registration(reg));
                }
            }
            &OpKind::EpFlush { seq } => {
                if let (true, Some(ep)) = (ok, &ep) {
                    ep.flushed_through.set(ep.flushed_through.get().max(seq));
                }
            }
            &OpKind::WorkerFlush { seq } => {
                if ok {
                    let w = &self.worker;
                    w.flushed_through.set(w.flushed_through.get().max(seq));
                }
            }
        }
        if !ok && let Some(ep) = &ep {
            let status = UcsStatus::from_raw(raw);
            if status.is_peer_failure() && ep.failed.get().is_none() {
                ep.failed.set(Some(status));
            }
        }
        // This may run inside a UCX callback, where destroying an rkey or
        // closing an endpoint (which progresses the worker) is forbidden: hand
        // the references to the worker, which releases them after
        // `ucp_worker_progress` returns. The rkey goes first, so it is
        // destroyed before the endpoint it was unpacked on.
        if let Some(rkey) = self.rkey.take() {
            self.worker.defer(Deferred::Rkey(rkey));
        }
        if let Some(ep) = ep {
            self.worker.defer(Deferred::Endpoint(ep));
        }
    }

    fn result(&self) -> Option<Result<()>> {
        self.status.get().map(|raw| {
            if raw == sys::UCS_OK {
                Ok(())
            } else {
                Err(Error::Call {
                    op: self.op,
                    status: UcsStatus::from_raw(raw),
                })
            }
        })
    }
}

/// The completion callback given to every `*_nbx` call.
///
/// # Safety
///
/// Called by UCX only, from `ucp_worker_progress` on the worker's thread, at
/// most once per request, with `user_data` being the pointer produced by
/// `Rc::into_raw` in [`submit`] for a request that did not complete
/// immediately.
unsafe extern "C" fn send_cb(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: per this function's contract, `user_data` is the `Rc<OpState>`
    // leaked by `submit` for this very request; it is reclaimed exactly once,
    // here (the immediate-completion path in `submit` never sees a callback).
    let state = unsafe { Rc::from_raw(user_data.cast_const().cast::<OpState>()) };
    state.complete(status);
    // SAFETY: `request` is the live UCX request this callback completes;
    // freeing it from its own completion callback is the documented pattern
    // (ucp.h, `ucp_request_free`), and nothing else frees it: `submit` hands
    // ownership of the request to this callback.
    unsafe { result::request::free(request) };
    drop(state);
}

/// What a request carries besides its callback and user data.
#[derive(Default)]
pub(crate) struct RequestExtras {
    /// `UCP_OP_ATTR_FIELD_MEMH`: the registration of a contiguous buffer.
    pub(crate) memh: Option<sys::ucp_mem_h>,
    /// `UCP_OP_ATTR_FIELD_FLAGS` when non-zero (e.g. `ucp_send_am_flags`).
    pub(crate) flags: u32,
    /// `UCP_OP_ATTR_FIELD_DATATYPE` (UCX assumes `ucp_dt_make_contig(1)`).
    pub(crate) datatype: Option<sys::ucp_datatype_t>,
}

/// Submits an operation. `call` receives the request parameters (callback,
/// user data, and `memh` when given) and must make exactly one `*_nbx` call
/// with them, returning its status pointer.
pub(crate) fn submit(
    state: Rc<OpState>,
    memh: Option<sys::ucp_mem_h>,
    call: impl FnOnce(&sys::ucp_request_param_t) -> sys::ucs_status_ptr_t,
) -> Result<Completion> {
    let extras = RequestExtras {
        memh,
        ..RequestExtras::default()
    };
    submit_with(state, extras, call)
}

/// [`submit`] with flags and a datatype besides `memh`.
pub(crate) fn submit_with(
    state: Rc<OpState>,
    extras: RequestExtras,
    call: impl FnOnce(&sys::ucp_request_param_t) -> sys::ucs_status_ptr_t,
) -> Result<Completion> {
    let user_data = Rc::into_raw(Rc::clone(&state)).cast_mut().cast::<c_void>();
    let mut mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
    let mut param = sys::ucp_request_param_t {
        user_data,
        ..Default::default()
    };
    param.cb.send = Some(send_cb);
    if let Some(memh) = extras.memh {
        mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
        param.memh = memh;
    }
    if extras.flags != 0 {
        mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = extras.flags;
    }
    if let Some(datatype) = extras.datatype {
        mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE;
        param.datatype = datatype;
    }
    param.op_attr_mask = mask;
    let ret = call(&param);
    if ret.is_null() || ptr_is_err(ret) {
        // Completed (or failed) immediately: UCX will not call the callback.
        // SAFETY: `user_data` is the `Rc::into_raw` above and UCX did not take
        // ownership of it (no request was returned), so it is reclaimed once.
        drop(unsafe { Rc::from_raw(user_data.cast_const().cast::<OpState>()) });
        let raw = if ret.is_null() {
            sys::UCS_OK
        } else {
            ptr_status(ret)
        };
        state.complete(raw);
        if raw != sys::UCS_OK {
            return Err(Error::Call {
                op: state.op,
                status: UcsStatus::from_raw(raw),
            });
        }
    }
    // Otherwise a request is in flight and `send_cb` owns `user_data`.
    Ok(Completion { state })
}

/// The completion of a non-blocking operation (a put, a message send or a
/// flush).
///
/// Poll it with [`Completion::result`], or wait for it with
/// [`Worker::wait`](super::Worker::wait). Dropping it does not cancel the
/// operation and does not block: the operation runs to completion inside UCX
/// and releases what it holds when it does.
///
/// A put is *locally* complete when its completion is `Ok`: the source range
/// may be reused. Remote visibility needs a flush of the endpoint (or worker)
/// issued after the put, completed `Ok`.
///
/// A message ([`Endpoint::send_message`](super::Endpoint::send_message)) is
/// likewise *locally* complete when its completion is `Ok`: the parts it was
/// gathered from may change again (its header was copied at the send).
/// Nothing reports delivery: the receiver may drop a message (its
/// [`MessageLimits`](super::MessageLimits)) without the sender knowing, so
/// a protocol that needs to know answers with a message of its own.
pub struct Completion {
    state: Rc<OpState>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("op", &self.state.op)
            .field("status", &self.state.status.get().map(UcsStatus::from_raw))
            .finish()
    }
}

impl Completion {
    pub(crate) fn done(state: Rc<OpState>) -> Self {
        state.complete(sys::UCS_OK);
        Self { state }
    }

    /// `None` while in flight; then the operation's outcome.
    pub fn result(&self) -> Option<Result<()>> {
        self.state.result()
    }

    /// True once the operation has completed (successfully or not).
    pub fn is_done(&self) -> bool {
        self.state.status.get().is_some()
    }

    /// The UCX routine this completion belongs to.
    pub fn op(&self) -> &'static str {
        self.state.op
    }

    pub(crate) fn worker(&self) -> &Rc<WorkerInner> {
        &self.state.worker
    }
}
