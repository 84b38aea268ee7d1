//! The peer protocol's two state machines, inside the sans-I/O core: the
//! target role in `target`, the source role in `source`, and what they
//! share: `config` and `reports` (the public values), `state`, the message
//! `dispatch`, the `timers`, and the driver's read-only `queries`.
//!
//! **Target** (the destination, which pulls): a fetch or deliver of keys the
//! request's router hint places on a peer reserves FILLING slots and becomes a
//! target operation: `start_write` naming, per key, the runner-owned pool
//! elements it grants. States, with the reference runtime's deadlines:
//!
//! ```text
//! WaitingWriteDone --write_done / refused--> Finished
//!        | op deadline: fills DISCARDING, callers fail, probe #1
//!        v
//! WaitingTerminal --terminal proof--> Finished (slots freed)
//!        | abandonment deadline: uncertain notice, probe #2
//!        v
//! Quarantined --terminal proof--> Finished (slots freed, quiesced notice)
//! ```
//!
//! A late success after the op deadline never commits: the slots are freed.
//! Elapsed time alone never frees a quarantined destination. Terminal proof
//! is a terminal reply from the incarnation the op was sent to, a refusal,
//! or a **death report**: a probe ack from the op's own source endpoint, by
//! the process serving there now, naming the op's incarnation as dead
//! (`dead_incarnation`; that process was told so by the guard, which saw
//! the old one exit by its pidfd: it can write nothing any more). A death
//! report ends every op of that endpoint sent to that incarnation at once.
//! A quarantined op is probed again, up to [`MAX_REPROBES_PER_ACK`] per
//! endpoint, whenever its endpoint acknowledges our metadata afresh (a new
//! process there, or the same one after an expiry or a lost session), so a
//! restarted or backup runner that knows the old incarnation dead frees its
//! slots without an engine restart; one that does not answers non-terminal
//! and the slots stay held.
//!
//! **Source** (the peer that holds the pages): a `start_write` is checked
//! against the target's advertised regions (every element in range, sizes
//! equal), READY keys are claimed, and one put action covers them; after the
//! put and flush complete, `write_done` reports the completed indices. Probes
//! install sticky cancellation fences; a stalled source refuses new writes
//! until restart; a refused or foreign request gets `write_refused` or a
//! terminal failure, and is counted. A probe naming an incarnation of this
//! endpoint that the guard confirmed dead ([`Core::set_dead_incarnations`])
//! is answered with a death report.

use super::*;

mod config;
mod dispatch;
mod queries;
mod reports;
mod source;
mod state;
mod target;
mod timers;

pub use config::{
    MAX_ADVERTISED_REGIONS, MAX_DEAD_INCARNATIONS, MAX_FENCES_PER_TARGET, MAX_REMEMBERED_PEERS,
    MAX_REPROBES_PER_ACK, MAX_RKEY_LEN, MAX_ROUTE_BUDGETS, MAX_WORKER_ADDRESS_LEN, PeerConfig,
    RouteBudget,
};
pub use reports::{ConnectFailure, PeerCounters, PeerNotice, PeerStateSizes, PutSpan};
pub(in crate::machine) use state::{Awaited, PeerState, PendingSourceWrite, RequestHint};
use state::{Route, SourceRole, SourceWrite, TargetOp, TargetRole, TargetState, WriteState};

use kvcr_contracts::endpoint::ControlEndpoint;
use kvcr_contracts::hint::{FetchHint, RequestId};
use kvcr_contracts::incarnation::Incarnation;
use kvcr_contracts::protocol::{
    Body, CompletedIndices, Header, Message, RegionAdvert, RouteGeneration, SharedMemoryAdvert,
    WriteOutcome,
};
