//! kvcr-foundation: slice 1 of 5, the rank-local contracts and the runner, as
//! one facade over the slice's crate group.
//!
//! | crate | what | re-exported as |
//! |---|---|---|
//! | `kvcr-contracts` | keys, endpoints, incarnations, hints, inventory events, peer frames; pure | the crate root |
//! | `kvcr-ucx` | the system UCX binding and its safe layer | [`ucx`] (feature `runner`) |
//! | `kvcr-sys` | the runner's non-UCX unsafe code (mappings, memfd pools, copies, system calls) behind safe types | [`sys`] (feature `runner`) |
//! | `kvcr-runner-core` | the runner's sans-I/O core | [`runner_core`] (feature `runner`) |
//! | `kvcr-runner` | the rank-local runner: pools, copy thread, control channel, peer thread; the guard's lease client | [`runner`] (feature `runner`) |
//! | `kvcr-guard` | the guard: keeps pools, journal and control listener across engine restarts; its binary | [`guard`] (feature `runner`) |
//! | `kvcr-publisher` | inventory on the vLLM/Dynamo KV-event wire | [`publisher`] (feature `publisher`) |
//!
//! Engines that link the whole slice depend on this crate; a router or tool
//! that needs only the contracts depends on `kvcr-contracts` directly, which
//! no feature unification can widen into tokio, UCX or ZMQ.
//!
//! Each crate has its own error type: [`Error`] here is the contracts' error;
//! the runner's is [`runner::Error`] and the publisher's [`publisher::Error`].

#![forbid(unsafe_code)]

pub use kvcr_contracts::*;

#[cfg(feature = "runner")]
pub use kvcr_guard as guard;
#[cfg(feature = "publisher")]
pub use kvcr_publisher as publisher;
#[cfg(feature = "runner")]
pub use kvcr_runner as runner;
#[cfg(feature = "runner")]
pub use kvcr_runner_core as runner_core;
#[cfg(feature = "runner")]
pub use kvcr_sys as sys;
#[cfg(feature = "runner")]
pub use kvcr_ucx as ucx;
