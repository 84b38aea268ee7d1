//! kvcr-contracts: the rank-local contracts every kvcr crate, engine and router
//! shares.
//!
//! Pure: no I/O, no unsafe, no clock, and no async runtime or FFI crate among
//! its dependencies, so a router or tool can depend on it alone. It is the
//! bottom of slice 1 (`kvcr-foundation` re-exports it at its root):
//!
//! * [`key`]: [`BlockKey`] (the router's 64-bit hash; signed and unsigned wire
//!   forms normalise to one value), [`Namespace`] (compatibility digest, LoRA
//!   adapter, cache salt), [`ScopedKey`], and the SHA-256 [`PageHashChain`].
//! * [`endpoint`]: dialable [`ControlEndpoint`]s, bind addresses, the loopback
//!   [`AdvertisePolicy`], per-DP port strides ([`RankLayout`]) and the
//!   all-or-nothing [`WorkerEndpointMap`].
//! * [`incarnation`]: [`Incarnation`] ids, fresh per process and per reset.
//! * [`member`]: [`MemberKey`], the public key a member's sessions prove.
//! * [`hint`]: the `kv.fetch@1.0` router-hint envelope ([`HintEnvelope`],
//!   [`FetchHint`]) and attempt-scoped snapshots ([`HintSnapshot`], [`AttemptLedger`]).
//! * [`tier`]: [`Owner`], [`Tier`], wire [`Medium`] names and [`InventoryEvent`]s.
//! * [`protocol`]: the peer control messages ([`protocol::Message`]) and their
//!   versioned, length-prefixed binary [`protocol::codec::FrameCodec`].
//!
//! Every fallible function returns the crate's one error type, [`Error`].

#![forbid(unsafe_code)]

pub mod endpoint;
pub mod error;
pub mod hint;
pub mod incarnation;
pub mod key;
pub mod member;
pub mod protocol;
pub mod tier;

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
pub use member::MemberKey;
pub use tier::{InventoryEvent, InventoryScope, InventorySink, Medium, Owner, Tier, VecSink};
