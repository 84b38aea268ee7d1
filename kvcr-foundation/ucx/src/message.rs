//! Active messages (`ucp_am_*`), the receiving side: a bounded inbox on the
//! worker, and the [`ActiveMessage`]s taken out of it.
//!
//! [`Worker::accept_messages`] installs one receive callback per message id
//! (`ucp_worker_set_am_recv_handler` with `UCP_AM_FLAG_WHOLE_MSG`, so UCX
//! reassembles multi-fragment eager messages before the callback sees them).
//! UCX runs the callback inside `ucp_worker_progress`, on the worker's
//! thread. It never calls UCX and never panics; it copies the header, and
//! either keeps UCX's own data buffer (`UCP_AM_RECV_ATTR_FLAG_DATA`: the
//! callback returns `UCS_INPROGRESS`, and the [`ActiveMessage`] releases the
//! buffer with `ucp_am_data_release` when it is dropped) or copies the data
//! (UCX's buffer is gone once the callback returns `UCS_OK`). What the
//! worker holds is bounded by the id's [`MessageLimits`]; a message that
//! does not fit, and a rendezvous message (never received: returning
//! `UCS_OK` drops its descriptor), is dropped and counted.
//!
//! Sending is [`Endpoint::send_message`](super::Endpoint::send_message).

use std::cell::Cell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::rc::Rc;

use super::worker::{Worker, WorkerInner};
use super::{result, sys};
use crate::error::Result;

/// Bounds on what the worker holds of received messages.
///
/// Per message id (set by [`Worker::accept_messages`]). A message is held
/// from its arrival (during [`Worker::progress`]) until its
/// [`ActiveMessage`] is dropped, whether or not it has been taken yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageLimits {
    /// The largest header accepted, in bytes.
    pub max_header: usize,
    /// The largest data accepted, in bytes.
    pub max_data: usize,
    /// How many messages of this id the worker holds at most at once; one
    /// arriving while this many are held is dropped.
    pub max_held: usize,
}

/// A received message's data.
enum Payload {
    /// Copied out of UCX's buffer during the callback (UCX did not offer to
    /// keep it, or it was empty).
    Copied(Box<[u8]>),
    /// UCX's own receive buffer (`UCP_AM_RECV_ATTR_FLAG_DATA`), kept by
    /// returning `UCS_INPROGRESS`: `len > 0` bytes at `ptr`, read-only, valid
    /// until `ucp_am_data_release(worker, ptr)`.
    Ucx { ptr: NonNull<c_void>, len: usize },
}

/// A message as the callback queues it. It holds no worker reference (the
/// callback only has its `arg`); [`Worker::take_messages`] adds one. Queued
/// UCX buffers are released by [`Messages::close`] if never taken.
struct Received {
    id: u16,
    header: Box<[u8]>,
    payload: Payload,
    /// The id's held count, already incremented for this message.
    held: Rc<Cell<usize>>,
}

/// The worker's queue of received messages and its drop count, shared by
/// the worker and its handlers.
struct Inbox {
    /// Oldest first. A `Cell` moved out and back (never borrowed across a
    /// call), so the callback cannot panic on a borrow.
    queue: Cell<VecDeque<Received>>,
    dropped: Cell<u64>,
    /// False once the worker is being destroyed: from then on the callback
    /// queues nothing (nothing would release it before `ucp_worker_destroy`).
    open: Cell<bool>,
}

impl Inbox {
    fn count_drop(&self) -> sys::ucs_status_t {
        self.dropped.set(self.dropped.get().saturating_add(1));
        // For every kind of message (eager or rendezvous) `UCS_OK` tells UCX
        // the data need not persist: it frees it or drops the descriptor.
        sys::UCS_OK
    }
}

/// One accepted id: what its receive callback's `arg` points at
/// (`Rc::as_ptr`). The worker keeps the `Rc` until after
/// `ucp_worker_destroy`, so the pointer is valid whenever UCX can call the
/// callback; the handler is only ever read through a shared reference, its
/// state changing through `Cell`s.
struct Handler {
    id: u16,
    limits: Cell<MessageLimits>,
    /// Messages of this id queued or taken and not yet dropped; each message
    /// holds a reference and decrements it when it goes.
    held: Rc<Cell<usize>>,
    inbox: Rc<Inbox>,
}

impl Handler {
    /// The body of [`am_recv_cb`]: checks the message against the limits,
    /// then queues it. Returns `UCS_INPROGRESS` exactly when it keeps UCX's
    /// data buffer. Calls no UCX routine and never panics.
    ///
    /// # Safety
    ///
    /// As UCX passes them to the receive callback: `header` points at
    /// `header_len` readable bytes unless `header_len` is 0; unless `attr`
    /// has `UCP_AM_RECV_ATTR_FLAG_RNDV`, `data` points at `len` readable
    /// bytes, which persist after the callback when it returns
    /// `UCS_INPROGRESS` if `attr` has `UCP_AM_RECV_ATTR_FLAG_DATA`.
    unsafe fn receive(
        &self,
        header: *const c_void,
        header_len: usize,
        data: *mut c_void,
        len: usize,
        attr: u64,
    ) -> sys::ucs_status_t {
        let inbox = &*self.inbox;
        let limits = self.limits.get();
        // A rendezvous message would need `ucp_am_recv_data_nbx` (a UCX call,
        // into a buffer as large as the sender says); it is never received.
        // `Endpoint::send_message` forces eager.
        if !inbox.open.get()
            || attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0
            || header_len > limits.max_header
            || len > limits.max_data
            || self.held.get() >= limits.max_held
            || (header_len > 0 && header.is_null())
        {
            return inbox.count_drop();
        }
        let header = if header_len == 0 {
            Box::default()
        } else {
            // SAFETY: per the contract, `header` (non-null, checked) points
            // at `header_len` readable bytes for the duration of the call;
            // they are copied before it returns.
            Box::from(unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_len) })
        };
        let keep = attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_DATA) != 0;
        let (payload, status) = match NonNull::new(data) {
            _ if len == 0 => (Payload::Copied(Box::default()), sys::UCS_OK),
            None => return inbox.count_drop(),
            Some(ptr) if keep => (Payload::Ucx { ptr, len }, sys::UCS_INPROGRESS),
            Some(ptr) => {
                // SAFETY: per the contract, `data` (non-null) points at `len`
                // readable bytes for the duration of the call; copied here.
                let bytes = unsafe { std::slice::from_raw_parts(ptr.as_ptr().cast::<u8>(), len) };
                (Payload::Copied(Box::from(bytes)), sys::UCS_OK)
            }
        };
        self.held.set(self.held.get().saturating_add(1));
        let mut queue = inbox.queue.take();
        queue.push_back(Received {
            id: self.id,
            header,
            payload,
            held: Rc::clone(&self.held),
        });
        inbox.queue.set(queue);
        status
    }
}

/// The receive callback given to `ucp_worker_set_am_recv_handler`.
///
/// # Safety
///
/// Called by UCX only, from `ucp_worker_progress` on the worker's thread,
/// with `arg` being the `Rc::as_ptr` of a [`Handler`] its worker still owns
/// (see [`Messages::accept`]) and the other arguments as UCX documents them
/// for `ucp_am_recv_callback_t` (see [`Handler::receive`]).
unsafe extern "C" fn am_recv_cb(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: per this function's contract `arg` points at a live `Handler`
    // (the worker holds its `Rc` until after `ucp_worker_destroy`); only a
    // shared reference is formed, and the handler mutates through `Cell`s.
    let handler = unsafe { &*arg.cast_const().cast::<Handler>() };
    let attr = if param.is_null() {
        0
    } else {
        // SAFETY: a non-null `param` points at UCX's receive parameters,
        // valid for the duration of the callback.
        unsafe { (*param).recv_attr }
    };
    // SAFETY: `header`, `data` and their lengths come straight from UCX, as
    // `Handler::receive` requires.
    unsafe { handler.receive(header, header_length, data, length, attr) }
}

/// A worker's active-message state: its inbox and its accepted ids.
///
/// Owned by [`WorkerInner`]; [`Messages::close`] runs in the worker's `Drop`
/// before `ucp_worker_destroy`, and the handlers (the callbacks' `arg`s) are
/// freed with this struct, after it.
pub(crate) struct Messages {
    inbox: Rc<Inbox>,
    /// Never shrinks: a handler stays registered with UCX until the worker
    /// is destroyed. Moved out and back, like the inbox queue.
    handlers: Cell<Vec<Rc<Handler>>>,
}

impl Messages {
    pub(crate) fn new() -> Self {
        Self {
            inbox: Rc::new(Inbox {
                queue: Cell::new(VecDeque::new()),
                dropped: Cell::new(0),
                open: Cell::new(true),
            }),
            handlers: Cell::new(Vec::new()),
        }
    }

    /// Installs the receive callback for `id` on `worker`, or replaces the
    /// limits of the one installed.
    fn accept(&self, worker: sys::ucp_worker_h, id: u16, limits: MessageLimits) -> Result<()> {
        let mut handlers = self.handlers.take();
        if let Some(h) = handlers.iter().find(|h| h.id == id) {
            h.limits.set(limits);
            self.handlers.set(handlers);
            return Ok(());
        }
        let handler = Rc::new(Handler {
            id,
            limits: Cell::new(limits),
            held: Rc::new(Cell::new(0)),
            inbox: Rc::clone(&self.inbox),
        });
        let params = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            ),
            id: u32::from(id),
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(am_recv_cb),
            arg: Rc::as_ptr(&handler).cast_mut().cast::<c_void>(),
        };
        // SAFETY: live worker on its thread (the caller holds the worker);
        // `params` is fully initialised, naming every field it sets; `arg`
        // points at a handler that this struct keeps alive (pushed below)
        // until after `ucp_worker_destroy`, as `am_recv_cb` requires.
        let installed = unsafe { result::worker::set_am_recv_handler(worker, &params) };
        // UCX installs the callback only on success (it checks the context's
        // features and the flags first), so a refused handler is not kept.
        if installed.is_ok() {
            handlers.push(handler);
        }
        self.handlers.set(handlers);
        installed
    }

    /// Stops queuing and releases the UCX buffers of messages never taken.
    /// Called by the worker's `Drop`, right before `ucp_worker_destroy`.
    pub(crate) fn close(&self, worker: sys::ucp_worker_h) {
        self.inbox.open.set(false);
        for received in self.inbox.queue.take() {
            if let Payload::Ucx { ptr, .. } = received.payload {
                // SAFETY: `ptr` is a buffer UCX handed to the callback of
                // this worker, kept with `UCS_INPROGRESS` and not released
                // (it was never taken, so no `ActiveMessage` owns it); the
                // worker is still alive; released exactly once, here.
                unsafe { result::worker::am_data_release(worker, ptr.as_ptr()) };
            }
        }
    }
}

/// A received active message: its id, a copy of its header, and its data.
/// `!Send`, like the worker it came from.
///
/// The data is either UCX's own receive buffer, kept without a copy and
/// released (`ucp_am_data_release`) when the message is dropped, or a copy.
/// The message holds its worker, so the worker is destroyed only after every
/// message still holding a UCX buffer has released it. Until it is dropped,
/// the message counts against its id's [`MessageLimits::max_held`].
pub struct ActiveMessage {
    id: u16,
    header: Box<[u8]>,
    payload: Payload,
    held: Rc<Cell<usize>>,
    /// Released last (after `Drop::drop` released a UCX buffer), so the
    /// worker outlives the buffer.
    worker: Rc<WorkerInner>,
}

impl std::fmt::Debug for ActiveMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActiveMessage")
            .field("id", &self.id)
            .field("header_len", &self.header.len())
            .field("data_len", &self.data().len())
            .field("held_by_ucx", &self.is_held_by_ucx())
            .finish()
    }
}

impl ActiveMessage {
    /// The message id it was sent with.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// The message header (a copy).
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// The message data.
    pub fn data(&self) -> &[u8] {
        match &self.payload {
            Payload::Copied(bytes) => bytes,
            // SAFETY: UCX's buffer of `len` bytes, kept past the callback
            // with `UCS_INPROGRESS` and released only in `Drop`, so it is
            // valid for as long as `&self`; UCX does not write to it once it
            // has handed it over, and nothing here does.
            Payload::Ucx { ptr, len } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr().cast_const().cast::<u8>(), *len)
            },
        }
    }

    /// Whether the data is UCX's receive buffer (kept without a copy) rather
    /// than a copy.
    pub(crate) fn is_held_by_ucx(&self) -> bool {
        matches!(self.payload, Payload::Ucx { .. })
    }
}

impl Drop for ActiveMessage {
    fn drop(&mut self) {
        if let Payload::Ucx { ptr, .. } = self.payload {
            // SAFETY: `ptr` is a buffer UCX handed to this worker's receive
            // callback and kept with `UCS_INPROGRESS`; the worker is alive
            // (this message holds it) and used on its own thread (`!Send`);
            // released exactly once, here (the payload is never read again).
            unsafe { result::worker::am_data_release(self.worker.handle, ptr.as_ptr()) };
        }
        self.held.set(self.held.get().saturating_sub(1));
    }
}

impl Worker {
    /// Accepts active messages with `id` from any endpoint of this worker
    /// (`ucp_worker_set_am_recv_handler` with `UCP_AM_FLAG_WHOLE_MSG`). They
    /// arrive during [`progress`](Worker::progress) (and every wait, which
    /// progresses) and are taken with [`take_messages`](Worker::take_messages).
    ///
    /// A message whose header or data exceeds `limits`, one arriving while
    /// `limits.max_held` messages of this id are held, and a rendezvous
    /// message (never received: UCX drops it, and its sender's operation
    /// completes `Ok`) are dropped and counted
    /// ([`dropped_messages`](Worker::dropped_messages)); the sender is not
    /// told. Calling again for the same id replaces its limits (messages
    /// already held stay).
    ///
    /// The limits apply when UCX delivers a whole message: a multi-fragment
    /// message is reassembled inside UCX (in a buffer of the full size)
    /// before the callback sees, and possibly drops, it.
    pub fn accept_messages(&self, id: u16, limits: MessageLimits) -> Result<()> {
        self.inner.messages.accept(self.inner.handle, id, limits)
    }

    /// The messages received (during [`progress`](Worker::progress)) since
    /// the last call, oldest first, all ids together.
    pub fn take_messages(&self) -> Vec<ActiveMessage> {
        self.inner
            .messages
            .inbox
            .queue
            .take()
            .into_iter()
            .map(|r| ActiveMessage {
                id: r.id,
                header: r.header,
                payload: r.payload,
                held: r.held,
                worker: Rc::clone(&self.inner),
            })
            .collect()
    }

    /// The largest header [`Endpoint::send_message`](super::Endpoint::send_message)
    /// sends from this worker (UCX's `max_am_header`: what fits the first
    /// fragment on every transport of the worker).
    pub fn max_message_header(&self) -> usize {
        self.inner.max_am_header
    }

    /// Messages dropped so far, all ids together: over a limit, over
    /// `max_held`, or sent with rendezvous.
    pub fn dropped_messages(&self) -> u64 {
        self.inner.messages.inbox.dropped.get()
    }
}
