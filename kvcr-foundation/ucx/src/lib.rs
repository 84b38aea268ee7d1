//! kvcr-ucx: our binding to the system UCX and its safe layer.
//!
//! Part of slice 1 (`kvcr-foundation`); depends on no other kvcr crate. Its
//! users are the runner's peer thread and `kvcr-sys` (owned memory).
//!
//! The ladder, as cudarc does it for CUDA:
//!
//! 1. [`sys`]: raw bindgen output for Debian's `libucx-dev` 1.13.1
//!    (`<ucp/api/ucp.h>`, narrow allowlist, committed; `ucx-bindgen`
//!    regenerates it). The library is found with pkg-config by `build.rs`.
//! 2. `result` (private): one thin function per UCX routine the crate
//!    calls, and the only place that calls into [`sys`]. Every
//!    `ucs_status_t` becomes a [`UcsStatus`] inside the crate's one error
//!    type ([`Error::Call`]); each `unsafe fn` states what its caller must
//!    uphold. Refusals made on the Rust side before UCX is called are
//!    [`Error::Refused`] with a [`UcxReason`].
//! 3. The safe types, for a destination-initiated put protocol and the
//!    small messages that steer it:
//!
//! | UCX | here |
//! |---|---|
//! | `ucp_context_h` | [`Context`] |
//! | `ucp_worker_h` (single-thread) | [`Worker`] (`!Send`), [`WaitPolicy`] |
//! | `ucp_worker_get_address` | [`WorkerAddress`] (checked envelope) |
//! | `ucp_ep_h` | [`Endpoint`] ([`Worker::connect`]) |
//! | `ucp_mem_h` | [`Registration`] (owned: [`Context::register_anon`], [`Context::register_vec`]; borrowed: [`Context::scope`]) |
//! | `ucp_rkey_pack` / `ucp_ep_rkey_unpack` | [`RkeyBuffer`] / [`RemoteKey`] |
//! | `ucp_put_nbx`, `ucp_*_flush_nbx` | [`Endpoint::put`], [`Endpoint::flush`], [`Worker::flush`] → [`Completion`] |
//! | `ucp_am_send_nbx` (eager; header + gathered registration ranges) | [`Endpoint::send_message`] → [`Completion`]; [`Worker::max_message_header`] (`ucp_worker_query`) |
//! | `ucp_worker_set_am_recv_handler`, `ucp_am_data_release` | [`Worker::accept_messages`] ([`MessageLimits`]), [`Worker::take_messages`] → [`ActiveMessage`], [`Worker::dropped_messages`] |
//! | `ucp_worker_progress`, `_get_efd`, `_arm` | [`Worker::progress`], [`Worker::event_fd`], [`Worker::arm`], [`Worker::wait`] |
//!
//! ## Ownership and drop order
//!
//! Everything is reference counted (`Rc`, so nothing here is `Send`), and
//! each object holds what must outlive it:
//! an in-flight operation holds its endpoint, its rkey and its registrations'
//! in-flight counts (a message send: one per part, plus its header copy and
//! iov array); an rkey holds its endpoint; an endpoint holds its worker; a
//! received [`ActiveMessage`] holds its worker (it may keep UCX's receive
//! buffer, released when it drops); a worker and a registration hold the
//! context. So, whatever order handles are dropped in, UCX sees: operations
//! complete → rkeys destroyed (after a flush of their puts) → endpoints
//! closed → received buffers released (those never taken by the worker
//! itself) → workers destroyed (and only then the state their receive
//! callbacks point at freed); and registrations unmapped (after their puts
//! and sends complete) → owned memory freed → `ucp_cleanup` last. Errors in `Drop` are recorded on the context
//! ([`Context::take_drop_errors`]); `Drop` never panics.
//!
//! ## Threading
//!
//! Workers are created `UCS_THREAD_MODE_SINGLE`: the thread that creates a
//! context drives all of it. Other threads talk to it through channels,
//! carrying the plain-bytes [`WorkerAddress`] and [`RkeyBuffer`], which are
//! `Send`.
//!
//! ## Unsafe
//!
//! Most of this crate is unsafe FFI. Every call into libucp goes through
//! `result`; the safe modules reach it in `unsafe` blocks. Every block carries a
//! `// SAFETY:` comment, every `unsafe fn` a `# Safety` section. Hostile
//! bytes never reach UCX's length-less parsers unchecked: worker addresses
//! and rkeys travel in checksummed envelopes ([`wire`]); the packed UCX blob
//! inside is walked field by field against UCX 1.13's formats ([`packed`])
//! when it is parsed and again, against the local context, right before UCX
//! sees it; and UCX gets a zero-padded copy.

mod binding;
mod context;
mod endpoint;
pub mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod memory;
mod message;
pub mod packed;
#[cfg(feature = "perftest")]
pub mod perftest;
mod request;
mod result;
mod status;
pub mod sys;
pub mod wire;
mod worker;

#[cfg(test)]
mod packed_tests;
#[cfg(test)]
mod tests;

pub use binding::{attaches_shared_memory, validate_process_binding};
pub use context::{Context, ContextConfig, ErrorMode, TCP_SEGMENT_SIZES, library_version};
pub use endpoint::{CloseMode, DROP_WAIT, Endpoint, RemoteKey};
pub use error::{Error, Result};
pub use memory::{AnonOptions, OwnedMemory, Registration, Scope};
pub use message::{ActiveMessage, MessageLimits};
pub use packed::{AddressProblem, Limits, validate_rkey, validate_worker_address};
pub use request::Completion;
pub use status::{UcsStatus, UcxReason};
pub use wire::{RkeyBuffer, WorkerAddress};
pub use worker::{WaitPolicy, Worker, WorkerEvents};
