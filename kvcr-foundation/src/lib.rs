//! kvcr-foundation: the rank-local contracts every kvcr slice, engine and router
//! shares.
//!
//! This crate is slice 1 of 5. Its contract modules are pure (no I/O, no
//! unsafe, no ambient time) and are all a router or tool gets when it depends on
//! the crate with `default-features = false`:
//!
//! * [`key`]: [`BlockKey`] (the router's 64-bit hash; signed and unsigned wire
//!   forms normalise to one value), [`Namespace`] (compatibility digest, LoRA
//!   adapter, cache salt), [`ScopedKey`], and the SHA-256 [`PageHashChain`].
//! * [`endpoint`]: dialable [`ControlEndpoint`]s, bind addresses, the loopback
//!   [`AdvertisePolicy`], per-DP port strides ([`RankLayout`]) and the
//!   all-or-nothing [`WorkerEndpointMap`].
//! * [`incarnation`]: [`Incarnation`] ids, fresh per process and per reset.
//! * [`hint`]: the `kv.fetch@1.0` router-hint envelope ([`HintEnvelope`],
//!   [`FetchHint`]) and attempt-scoped snapshots ([`HintSnapshot`], [`AttemptLedger`]).
//! * [`tier`]: [`Owner`], [`Tier`], wire [`Medium`] names and [`InventoryEvent`]s.
//! * [`protocol`]: the peer control messages ([`protocol::Message`]) and their
//!   versioned, length-prefixed binary [`protocol::codec::FrameCodec`].
//!
//! Every fallible function returns the crate's one error type, [`Error`].
//!
//! The `runner` feature (on by default) is where the rank-local runner and its
//! drivers live; it is the only part allowed to do I/O.

// The contracts face has no unsafe code at all. With the runner, unsafe is
// denied everywhere except the named FFI/memory modules, which opt in with an
// explicit `#[allow(unsafe_code)]` on their `mod` line and document every block.
#![cfg_attr(not(feature = "runner"), forbid(unsafe_code))]
#![cfg_attr(feature = "runner", deny(unsafe_code))]

pub mod endpoint;
pub mod error;
pub mod hint;
pub mod incarnation;
pub mod key;
pub mod protocol;
#[cfg(feature = "runner")]
pub mod publisher;
#[cfg(feature = "runner")]
pub mod runner;
pub mod tier;
#[cfg(feature = "runner")]
#[allow(unsafe_code)]
pub mod ucx;

pub use endpoint::{
    AdvertisePolicy, BindAddress, ControlEndpoint, Host, RankCoordinate, RankLayout,
    WorkerEndpointMap,
};
pub use error::{Error, Result};
pub use hint::{AttemptId, AttemptLedger, FetchHint, HintEnvelope, HintSnapshot, RequestId};
pub use incarnation::Incarnation;
pub use key::{
    BlockKey, CompatDigest, Namespace, NamespaceId, PageDigest, PageHashChain, ScopedKey,
};
pub use tier::{InventoryEvent, InventoryScope, InventorySink, Medium, Owner, Tier, VecSink};
